"""Files a user is handed (a prepared dataset, a Hugging Face model directory, a checkpoint, a run directory)
that are broken or hostile: each is refused through the real CLI (`main(argv)`, in this process) with exit
status 2 and one line on stderr naming the file, the key and the rule, before Ray is joined. Issue 24.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raypar.controller import cli
from raypar.core import data
from raypar.core.config.schema import DataConfig
from tests.support.corpus import corpus, train_bpe
from tests.support.runs import TINY


def refused(capsys, argv: list[str], *expect: str) -> str:
    """Run the CLI; assert exit 2 and one line holding every `expect`; return the line."""
    rc = cli.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, (argv, rc, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("raypar: "), err[-3000:]
    for text in expect:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def train(tmp_path: Path, *args: str) -> list[str]:
    return ["train", str(TINY), "--run-dir", str(tmp_path / "run"), "--no-progress", *args]


# -- a prepared dataset whose index names files outside its directory -----------------------------------


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    """A dataset prepared with a BPE tokenizer (index.json records tokenizer.file)."""
    docs = corpus(30, 0)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = train_bpe(tmp_path / "tok.json", docs)
    cli.main(["prepare", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tok), "--out",
              str(tmp_path / "ds"), "--no-progress"])
    return tmp_path / "ds"


def _edit_index(ds: Path, change) -> None:
    index = json.loads((ds / data.INDEX).read_text())
    change(index)
    (ds / data.INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("outside", ["../../../../../../../../etc/hostname", "/etc/hostname", "a/../../x"])
def test_dataset_tokenizer_file_outside_its_directory_is_refused(prepared, tmp_path, capsys, no_ray, outside):
    _edit_index(prepared, lambda i: i["tokenizer"].update(file=outside))
    index = str(prepared / data.INDEX)
    refused(capsys, train(tmp_path, "--set", f"data.source='{prepared}'"), index, "tokenizer.file", outside)
    # What checkpoints record: nothing from outside is ever read.
    with pytest.raises(ValueError, match="tokenizer.file"):
        data.tokenizer_record(DataConfig(source=str(prepared)))


@pytest.mark.parametrize("dtype", ["bogus", "float64", 3])
def test_dataset_dtype_not_a_token_type_is_refused(prepared, tmp_path, capsys, no_ray, dtype):
    _edit_index(prepared, lambda i: i.update(dtype=dtype))
    argv = train(tmp_path, "--set", f"data.source='{prepared}'")
    refused(capsys, argv, str(prepared / data.INDEX), "dtype")


# -- model.init_from: a Hugging Face directory, checked whole before any actor starts --------------------


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    from tests.support.hf_models import make_hf_llama

    path = tmp_path_factory.mktemp("hf") / "llama"
    make_hf_llama(path, shard_size="20KB")  # several files and model.safetensors.index.json
    return path


def _hf_copy(src: Path, dst: Path, change) -> Path:
    """A copy of `src` at `dst`, then broken by change(dst)."""
    import shutil

    shutil.copytree(src, dst)
    change(dst)
    return dst


def _config(change):
    def edit(d: Path) -> None:
        body = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(change(body)))

    return edit


def _weight_map(change):
    def edit(d: Path) -> None:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        change(index["weight_map"], d)
        (d / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def _move_out(weight_map: dict, d: Path, how: str) -> None:
    """Point the index's first tensor at a copy of its file outside the model directory (a valid file, so
    only the path rule can stop it)."""
    name, file = next(iter(weight_map.items()))
    outside = d.parent / f"outside-{how}.safetensors"
    outside.write_bytes((d / file).read_bytes())
    weight_map[name] = str(outside) if how == "absolute" else f"../{outside.name}"


def _first_file(d: Path) -> Path:
    return sorted(d.glob("*.safetensors"))[0]


def _retensor(d: Path) -> None:
    """The first file's first tensor saved with one row too many."""
    from safetensors.torch import load_file, save_file

    file = _first_file(d)
    tensors = load_file(file)
    name = sorted(tensors)[0]
    t = tensors[name]
    tensors[name] = t.new_zeros((t.shape[0] + 1, *t.shape[1:]))
    save_file(tensors, file, metadata={"format": "pt"})


HF_BREAKAGES = {
    # what: (breakage, text the line must hold)
    "weight-map-dotdot": (_weight_map(lambda m, d: _move_out(m, d, "dotdot")), "weight_map"),
    "weight-map-absolute": (_weight_map(lambda m, d: _move_out(m, d, "absolute")), "weight_map"),
    "config-list": (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json"),
    "config-not-utf8": (lambda d: (d / "config.json").write_bytes(b'{"a": "\xff\xfe"}'), "config.json"),
    "config-heads-0": (_config(lambda c: {**c, "num_attention_heads": 0}), "num_attention_heads"),
    "config-hidden-abc": (_config(lambda c: {**c, "hidden_size": "abc"}), "hidden_size"),
    "config-eps-nan": (_config(lambda c: {**c, "rms_norm_eps": float("nan")}), "rms_norm_eps"),
    "config-rope-list": (_config(lambda c: {**c, "rope_parameters": [1]}), "rope_parameters"),
    "no-weights": (lambda d: [f.unlink() for f in d.glob("*.safetensors*")], "no *.safetensors"),
    "index-garbage": (lambda d: (d / "model.safetensors.index.json").write_text("{nope"), "index.json"),
    "index-list": (lambda d: (d / "model.safetensors.index.json").write_text("[]"), "index.json"),
    "weight-map-list": (
        lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": []}'), "weight_map"
    ),
    "file-missing": (lambda d: _first_file(d).unlink(), "not found"),
    "file-truncated": (
        lambda d: _first_file(d).write_bytes(_first_file(d).read_bytes()[:-100]), "safetensors"
    ),
    "file-bad-header": (
        lambda d: _first_file(d).write_bytes((16).to_bytes(8, "little") + b"{not json at all"), "safetensors"
    ),
    "shape-mismatch": (_retensor, "config.json implies"),
    "tensor-missing": (
        _weight_map(lambda m, d: m.pop("model.norm.weight")), "no tensor model.norm.weight"
    ),
}


@pytest.mark.parametrize("kind", list(HF_BREAKAGES))
def test_init_from_broken_is_refused_up_front(hf_model, tmp_path, capsys, no_ray, kind):
    breakage, expect = HF_BREAKAGES[kind]
    bad = _hf_copy(hf_model, tmp_path / "bad", breakage)
    argv = train(tmp_path, "--set", f"model.init_from='{bad}'", "--set", "model.seq_len=16")
    line = refused(capsys, argv, "model.init_from", expect)
    assert str(bad) in line
    assert not (tmp_path / "run").exists()


def test_init_from_intact_passes_the_check(hf_model):
    from raypar.core.run_config import load_config

    cfg = load_config(str(TINY), [f"model.init_from='{hf_model}'", "model.seq_len=16"])
    assert cfg.model.d_model == 32


# -- raypar report: records of the wrong types ----------------------------------------------------------

GOOD_METRICS = [{"step": s, "loss": 2.0 - s / 10, "tokens_per_s": 100.0, "dp": 1 + s % 2, "pp": 1, "tp": 1}
                for s in range(4)]
GOOD_TIMELINE = [{"step": s, "dp": 0, "pp": 0, "tp": 0, "step_s": 0.01, "actor": "raypar:r:dp0.pp0.tp0",
                  "events": [["forward", 0, 0.0, 0.004], ["backward", 0, 0.004, 0.009]]} for s in range(4)]
BAD_RECORDS = {
    # name: (file, the bad record: a good one with these changes, the key the line names)
    "metrics-step-string": ("metrics", {"step": "x"}, "step"),
    "metrics-tokens-list": ("metrics", {"tokens_per_s": [1]}, "tokens_per_s"),
    "metrics-loss-string": ("metrics", {"loss": "abc"}, "loss"),
    "metrics-dp-null": ("metrics", {"dp": None}, "dp"),
    "metrics-expert-load-string": ("metrics", {"expert_load": "q"}, "expert_load"),
    "metrics-val-loss-list": ("metrics", {"val_loss": [0.5]}, "val_loss"),
    "timeline-op-unknown": ("timeline", {"events": [["bogus", 0, 0.0, 0.01]]}, "events"),
    "timeline-event-short": ("timeline", {"events": [["forward", 0]]}, "events"),
    "timeline-step-s-string": ("timeline", {"step_s": "fast"}, "step_s"),
}


@pytest.mark.parametrize("kind", list(BAD_RECORDS))
def test_report_refuses_a_record_of_the_wrong_type(tmp_path, capsys, kind):
    name, change, key = BAD_RECORDS[kind]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('[parallel]\nschedule = "1f1b"\npp = 1\n')
    for file, good in (("metrics", GOOD_METRICS), ("timeline", GOOD_TIMELINE)):
        records = [*good[:2], {**good[2], **change}, good[3]] if file == name else good
        (run / f"{file}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    refused(capsys, ["report", str(run)], f"{run / name}.jsonl:3", key)


# -- checkpoints whose manifest lies about the model, and what is done with them -------------------------


def _checkpoint(root: Path, change_manifest=None) -> Path:
    """A tiny model's checkpoint (one shard, meta.model, byte tokenizer); its manifest then edited by
    change_manifest(manifest). Returns the step directory."""
    import dataclasses

    from raypar.core import checkpoint
    from raypar.core.config.schema import ModelConfig
    from raypar.core.model.llama import LlamaStage

    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=256, seq_len=32)
    m = LlamaStage(cfg, seed=3)
    tensors = dict(m.named_parameters())
    specs = {n: checkpoint.ShardSpec.full(t.shape) for n, t in tensors.items()}
    meta = {"model": dataclasses.asdict(cfg), "tokenizer": {"kind": "bytes", "vocab_size": 256}}
    step = Path(checkpoint.save(str(root), 1, {"dp0.pp0.tp0": (tensors, specs)}, meta))
    if change_manifest:
        manifest = json.loads((step / "manifest.json").read_text())
        change_manifest(manifest)
        (step / "manifest.json").write_text(json.dumps(manifest))
    return step


def _claim_shape(name: str, shape: list[int]):
    """The manifest says tensor `name` has (global and local) `shape`."""
    def change(m: dict) -> None:
        m["tensors"][name]["global_shape"] = shape
        for shard in m["shards"]:
            if name in shard["tensors"]:
                shard["tensors"][name].update(shape=shape, global_shape=shape)

    return change


def _claim_vocab(vocab: int):
    """A manifest that says, consistently, that the model has `vocab` tokens: meta.model and the shapes of
    the embedding and head agree, only the memory they need is out of reach."""
    def change(m: dict) -> None:
        m["meta"]["model"]["vocab_size"] = vocab
        for name in ("embed.weight", "head.weight"):
            _claim_shape(name, [vocab, 32])(m)

    return change


GENERATE = ["generate", "{ckpt}", "--prompt", "x", "--max-tokens", "4"]
EXPORT = ["checkpoint", "export", "{ckpt}", "{out}/m.safetensors"]
EXPORT_HF = ["checkpoint", "export", "{ckpt}", "{out}/hf", "--format", "hf"]
# Sizes within the config rules' bounds (raypar.core.config.rules.MAX_SIZES), so that what refuses them is the
# check each case is about
CHECKPOINT_CASES = {
    # name: (manifest change, argv with {ckpt} and {out}, text the line must hold)
    "generate-no-meta-model": (lambda m: m["meta"].pop("model"), GENERATE, "meta.model"),
    "generate-d-model-2^16": (
        lambda m: m["meta"]["model"].update(d_model=2**16), GENERATE, "meta.model implies"
    ),
    "generate-heads-0": (lambda m: m["meta"]["model"].update(n_heads=0), GENERATE, "n_heads"),
    "generate-1e7-squared": (_claim_shape("embed.weight", [10**7, 10**7]), GENERATE, "implies"),
    "generate-huge-vocab": (_claim_vocab(2**32), GENERATE, "GiB of memory"),
    "generate-temperature-nan": (None, [*GENERATE, "--temperature", "nan"], "--temperature"),
    "generate-temperature-inf": (None, [*GENERATE, "--temperature", "inf"], "--temperature"),
    "generate-max-tokens-1e11": (
        None, ["generate", "{ckpt}", "--prompt", "x", "--max-tokens", str(10**11)], "--max-tokens"
    ),
    "generate-device-garbage": (None, [*GENERATE, "--device", "banana"], "--device"),
    "export-1e7-squared": (_claim_shape("embed.weight", [10**7, 10**7]), EXPORT, "GiB of memory"),
    "export-hf-no-meta-model": (lambda m: m["meta"].pop("model"), EXPORT_HF, "meta.model"),
    "export-hf-d-model-2^16": (
        lambda m: m["meta"]["model"].update(d_model=2**16), EXPORT_HF, "meta.model implies"
    ),
    "export-hf-huge-vocab": (_claim_vocab(2**32), EXPORT_HF, "GiB of memory"),
}


@pytest.mark.parametrize("kind", list(CHECKPOINT_CASES))
def test_checkpoint_that_lies_is_refused_before_allocating(tmp_path, capsys, kind):
    change, args, expect = CHECKPOINT_CASES[kind]
    step = _checkpoint(tmp_path / "ckpt", change)
    refused(capsys, [a.format(ckpt=step, out=tmp_path) for a in args], expect)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.safetensors").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_generate_on_cuda_without_a_gpu_is_refused(tmp_path, capsys):
    step = _checkpoint(tmp_path / "ckpt")
    argv = [a.format(ckpt=step) for a in GENERATE]
    refused(capsys, [*argv, "--device", "cuda"], "--device", "cuda")


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's /sys (read-only even for root)")
def test_hf_export_onto_a_read_only_place_is_one_line(tmp_path, capsys):
    step = _checkpoint(tmp_path / "ckpt")
    out = "/sys/raypar-export-test/hf"  # a directory no one, root included, may create
    refused(capsys, ["checkpoint", "export", str(step), out, "--format", "hf"], out, "cannot write")


def test_safetensors_export_does_not_overwrite(tmp_path, capsys):
    step = _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"an earlier export, or anything else")
    refused(capsys, ["checkpoint", "export", str(step), str(out)], str(out), "already exists")
    assert out.read_bytes() == b"an earlier export, or anything else"


# -- smaller ones: which key is named, config rules, the planner's search --------------------------------


@pytest.mark.parametrize("how", ["glob", "dir"])
def test_val_source_matching_nothing_is_named_as_val_source(tmp_path, capsys, no_ray, how):
    (tmp_path / "a-dir").mkdir()
    source = str(tmp_path / "nothing" / "*.txt") if how == "glob" else str(tmp_path / "a-dir")
    argv = train(tmp_path, "--set", f"data.val_source='{source}'", "--set", "train.eval_every=2")
    line = refused(capsys, argv, "data.val_source")
    assert "data.source" not in line


def test_val_source_empty_text_is_named_as_val_source(tmp_path, capsys, no_ray):
    (tmp_path / "empty.txt").write_text("")
    argv = train(tmp_path, "--set", f"data.val_source='{tmp_path / 'empty.txt'}'",
                 "--set", f"data.cache_dir='{tmp_path / 'cache'}'")
    refused(capsys, argv, "data.val_source", "empty")


def test_min_dp_above_max_dp_is_refused(tmp_path, capsys, no_ray):
    refused(capsys, train(tmp_path, "--set", "parallel.min_dp=3", "--set", "parallel.max_dp=2"),
            "parallel.max_dp", "parallel.min_dp=3")


def test_plan_with_a_billion_devices_answers_in_seconds(capsys):
    import signal
    import time

    def too_slow(*_):
        raise TimeoutError("raypar plan searched for more than 60 s")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(60)
    try:
        start = time.monotonic()
        argv = ["plan", str(TINY), "--device-memory", "80GB", "--devices"]
        refused(capsys, [*argv, str(10**9)], "--devices", "at most 1,048,576")
        assert cli.main([*argv, str(2**20)]) == 0  # the largest allowed: searched, nothing fits tiny
        assert "0 of 0 valid layouts" in capsys.readouterr().out
        assert time.monotonic() - start < 30
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
