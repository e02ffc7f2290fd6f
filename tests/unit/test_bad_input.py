"""Bad input never shows a traceback: every input of every subcommand, broken in every way that applies,
through the real CLI (`main(argv)`, in this process). Each case must exit 2 with one line on stderr that
names the key, file or flag (the `expect` text) and the rule, before Ray is joined or any actor starts.

Paths are tried missing, as a directory, as a plain file, unreadable (skipped as root, who reads
everything), as random bytes, as garbage or too deeply nested TOML/JSON; numbers as negative, zero, nan
and +-inf (zero only where zero is not allowed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from raypar.controller import cli
from raypar.core import checkpoint, data
from raypar.core.config.schema import Config
from tests.support.runs import TINY

DEEP = 50_000  # nesting that overflows Python's recursion limit in any recursive parser
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
ZERO_OK = {
    "train.warmup_steps", "train.seed", "train.max_failures", "train.min_lr", "train.weight_decay",
    "train.beta1", "train.beta2", "train.grad_clip", "checkpoint.every", "parallel.max_dp",
    "model.dropout", "model.moe_experts", "model.moe_aux_loss_coef",
    "model.moe_capacity_factor", "model.moe_bias_update_rate", "model.moe_shared_experts",  # 0: dropless, off
    "model.moe_d_ff",  # 0: d_ff
    "train.eval_every", "data.val_fraction",  # 0: no validation
    "parallel.zero",  # 0: no sharding
    "parallel.dp_shard",  # 0: all dp replicas shard the state
    "train.hang_watchdog_s",  # 0: a fifth of parallel.timeout_s
    "parallel.placement_timeout_s",  # 0: parallel.timeout_s
    "parallel.compression_start_step",
    "model.sliding_window",  # 0: no window (issue 47)
    "model.head_dim_override", "model.rope_original_max_len", "model.rope_attention_factor",  # 0: unset
}  # fmt: skip


def _numeric_keys() -> list[str]:
    keys = []
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(section.default_factory)
        keys += [f"{section.name}.{k}" for k, h in hints.items() if h in (int, float, int | str)]
    return keys


class Files:
    """Broken inputs of every kind, made once per test under `root`."""

    def __init__(self, root: Path):
        self.root = root
        self.missing = root / "missing"
        self.dir = root / "a-dir"
        self.dir.mkdir()
        self.file = self._write("a-file", b"just text\n")
        self.random = self._write("random.bin", b"\xff\xfe\x00" + bytes(range(256)) * 4)
        self.garbage = self._write("garbage.txt", b"[[[ this is = not { TOML or JSON\n")
        self.deep_toml = self._write("deep.toml", b"a = " + b"[" * DEEP + b"]" * DEEP)
        self.deep_json = self._write("deep.json", b"[" * DEEP + b"]" * DEEP)
        self.unreadable = self._write("unreadable.toml", b"[model]\n")
        self.unreadable.chmod(0)
        self.text = self._write("corpus/a.txt", b"hello world, " * 400)

    def _write(self, name: str, body: bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        return path

    def prepared(self, name: str, breakage: Callable[[Path], None]) -> Path:
        """A prepared token directory, then broken by `breakage(dir)`."""
        out = self.root / name
        data.prepare([str(self.text)], out, shard_tokens=2048)
        breakage(out)
        return out

    def ckpt(self, name: str, breakage: Callable[[Path], None] | None = None) -> Path:
        """A checkpoint root holding one checkpoint (step 2), then broken by `breakage(step_dir)`."""
        root = self.root / name
        tensors = {"embed.weight": torch.zeros(4, 4)}
        specs = {"embed.weight": checkpoint.ShardSpec.full((4, 4))}
        uri = checkpoint.save(str(root), 2, {"dp0.pp0.tp0": (tensors, specs)}, {"model": {}})
        if breakage:
            breakage(Path(uri))
        return root


def _index(out: Path, body: bytes) -> None:
    (out / data.INDEX).write_bytes(body)


def _edit_index(out: Path, change: Callable[[dict], None]) -> None:
    index = json.loads((out / data.INDEX).read_text())
    change(index)
    (out / data.INDEX).write_text(json.dumps(index))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _shard(step_dir: Path) -> Path:
    return next(step_dir.glob("shard-*.safetensors"))


def _mixtral_config(f: Files, field: str, value: object) -> Path:
    """A directory whose config.json is a Mixtral's with `field` set to `value` (refused before weights)."""
    out = f.root / f"mixtral-{field}"
    out.mkdir()
    body = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "num_local_experts": 4,
            "num_experts_per_tok": 2, field: value}  # fmt: skip
    (out / "config.json").write_text(json.dumps(body))
    return out


def _fifo(path: Path) -> Path:
    """A FIFO at `path` (replacing a file there): what blocks a reader that opens it until a writer comes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def _fifo_latest(root: Path) -> Path:
    _fifo(root / checkpoint.LATEST)
    return root


def _fifo_report_dir(f: Files) -> Path:
    d = f.root / "fifo-report"
    d.mkdir(exist_ok=True)
    (d / "config.toml").write_bytes(b'[parallel]\nschedule = "1f1b"\npp = 1\n')
    return d


def train(f: Files, *args: str) -> list[str]:
    return ["train", str(TINY), "--run-dir", str(f.root / "run"), "--no-progress", *args]


def _cases() -> list:
    cases: list = []

    def case(name: str, argv: Callable[[Files], list[str]], expect: Callable[[Files], str], root=False):
        marks = [pytest.mark.skipif(AS_ROOT, reason="root reads unreadable files")] if root else []
        cases.append(pytest.param(argv, expect, id=name, marks=marks))

    # -- train: the config file --------------------------------------------------------------------------
    for kind in ("missing", "dir", "random", "garbage", "deep_toml"):
        case(
            f"train-config-{kind}",
            lambda f, k=kind: ["train", str(getattr(f, k))],
            lambda f, k=kind: str(getattr(f, k)),
        )
    case(
        "train-config-unreadable",
        lambda f: ["train", str(f.unreadable)],
        lambda f: str(f.unreadable),
        root=True,
    )
    # -- train: every number, through --set -------------------------------------------------------------
    for key in _numeric_keys():
        values = ["-1", "nan", "inf", "-inf"] + ([] if key in ZERO_OK else ["0"])
        # The other MoE keys only mean something (and are only checked) with experts.
        moe = (
            ["--set", "model.moe_experts=4"]
            if key.startswith("model.moe_") and key != "model.moe_experts"
            else []
        )
        for value in values:
            case(
                f"train-set-{key}={value}",
                lambda f, k=key, v=value, extra=moe: train(f, *extra, "--set", f"{k}={v}"),
                lambda f, k=key: k,
            )
    case(
        "train-set-stage-layers",
        lambda f: train(f, "--set", "parallel.stage_layers=[-1]"),
        lambda f: "parallel.stage_layers",
    )
    case("train-set-no-equals", lambda f: train(f, "--set", "model.n_layers"), lambda f: "model.n_layers")
    case("train-set-unknown-key", lambda f: train(f, "--set", "model.colour=1"), lambda f: "model.colour")
    case("train-set-unknown-section", lambda f: train(f, "--set", "paint.colour=1"), lambda f: "paint")
    case(
        "train-set-deep",
        lambda f: train(f, "--set", "model.n_layers=" + "[" * DEEP + "]" * DEEP),
        lambda f: "model.n_layers",
    )
    case(
        "train-device-name", lambda f: train(f, "--set", "parallel.device='tpu'"), lambda f: "parallel.device"
    )
    case(
        "train-node-type-name",
        lambda f: train(f, "--set", "parallel.node_type='g 6'"),
        lambda f: "parallel.node_type: must be empty or the custom resource a worker type declares",
    )
    case(
        "train-compression-name",
        lambda f: train(f, "--set", "parallel.grad_compression='fp8'"),
        lambda f: "parallel.grad_compression",
    )
    for name in ("topk", "powersgd"):  # need an all-reduce: not with ZeRO >= 2
        case(
            f"train-compression-{name}-zero2",
            lambda f, n=name: train(
                f, "--set", f"parallel.grad_compression='{n}'", "--set", "parallel.zero=2"
            ),
            lambda f, n=name: f'parallel.grad_compression: "{n}" needs an all-reduce, so parallel.zero <= 1',
        )
    case("train-offload-name", lambda f: train(f, "--set", "train.offload='gpu'"), lambda f: "train.offload")
    case(
        "train-offload-without-zero",
        lambda f: train(f, "--set", "train.offload='cpu'", "--set", "parallel.zero=0"),
        lambda f: "parallel.zero >= 1",
    )
    # parallel.dp_shard (HSDP): whole groups of replicas, ZeRO state to shard, only what it composes with
    hsdp = ("--set", "parallel.dp=4", "--set", "parallel.zero=3", "--set", "train.global_batch=8")
    for label, extra, rule in (
        ("not-dividing", ("parallel.dp_shard=3",), "parallel.dp_shard: must divide parallel.dp=4"),
        ("one", ("parallel.dp_shard=1",), "parallel.dp_shard: 1 shards nothing"),
        ("zero0", ("parallel.dp_shard=2", "parallel.zero=0"), "needs parallel.zero >= 1"),
        ("compression", ("parallel.dp_shard=2", "parallel.zero=1", "parallel.grad_compression='topk'"),
         "needs parallel.grad_compression in ['none', 'bf16'], got 'topk'"),
        ("in-memory", ("parallel.dp_shard=2", "checkpoint.in_memory=true"),
         "recovers from the shard copies in the other groups; checkpoint.in_memory must be false"),
    ):
        sets = [a for x in extra for a in ("--set", x)]
        case(f"train-dp-shard-{label}", lambda f, s=sets: train(f, *hsdp, *s), lambda f, r=rule: r)
    # -- train: data -------------------------------------------------------------------------------------
    case(
        "train-data-glob-nothing",
        lambda f: train(f, "--set", f"data.source='{f.root}/nothing/*.txt'"),
        lambda f: "data.source",
    )
    case(
        "train-data-dir-without-index",
        lambda f: train(f, "--set", f"data.source='{f.dir}'"),
        lambda f: "data.source",
    )
    broken_indexes = {
        "random": lambda out: _index(out, b"\xff\xfe\x00garbage"),
        "garbage": lambda out: _index(out, b"{not json"),
        "deep": lambda out: _index(out, b"[" * DEEP + b"]" * DEEP),
        "list": lambda out: _index(out, b"[1, 2]"),
        "no-shards": lambda out: _edit_index(out, lambda i: i.pop("shards")),
        "shard-outside": lambda out: _edit_index(out, lambda i: i["shards"][0].update(file="../x.arrow")),
        "shard-missing": lambda out: (out / "tokens-00000.arrow").unlink(),
        "shard-truncated": lambda out: _truncate(out / "tokens-00000.arrow"),
        "shard-random": lambda out: (out / "tokens-00000.arrow").write_bytes(os.urandom(999)),
        "more-tokens": lambda out: _edit_index(out, lambda i: i["shards"][0].update(tokens=10**6)),
    }
    for kind, breakage in broken_indexes.items():
        case(
            f"train-data-prepared-{kind}",
            lambda f, k=kind, b=breakage: train(f, "--set", f"data.source='{f.prepared(k, b)}'"),
            lambda f, k=kind: str(f.root / k),
        )
    text = lambda f: f"data.source='{f.text}'"  # noqa: E731 - a text source: prepared into cache_dir
    case(
        "train-cache-dir-file",
        lambda f: train(f, "--set", text(f), "--set", f"data.cache_dir='{f.file}'"),
        lambda f: "data.cache_dir",
    )
    case(
        "train-cache-dir-in-file",
        lambda f: train(f, "--set", text(f), "--set", f"data.cache_dir='{f.file}/sub'"),
        lambda f: "data.cache_dir",
    )
    # -- train: outputs ----------------------------------------------------------------------------------
    case(
        "train-ckpt-dir-file",
        lambda f: train(f, "--set", f"checkpoint.dir='{f.file}'"),
        lambda f: "checkpoint.dir",
    )
    case(
        "train-ckpt-dir-in-file",
        lambda f: train(f, "--set", f"checkpoint.dir='{f.file}/sub'"),
        lambda f: "checkpoint.dir",
    )
    case(
        "train-ckpt-every-without-dir",
        lambda f: train(f, "--set", "checkpoint.every=2"),
        lambda f: "checkpoint.dir",
    )
    # in-memory copies live on a buddy replica: none at dp=1, nor when dp = "auto" may start at 1
    for name, extra in (
        ("dp1", []),
        ("auto-min1", ["--set", "parallel.dp='auto'", "--set", "parallel.max_dp=2"]),
        ("not-bool", ["--set", "parallel.dp=2"]),
    ):
        value = "2" if name == "not-bool" else "true"
        case(
            f"train-ckpt-in-memory-{name}",
            lambda f, e=extra, v=value: train(f, *e, "--set", f"checkpoint.in_memory={v}"),
            lambda f: "checkpoint.in_memory",
        )
    case(
        "train-ckpt-dir-bad-uri",
        lambda f: train(f, "--set", "checkpoint.dir='nosuchfs://x/y'"),
        lambda f: "checkpoint.dir",
    )
    case(
        "train-run-dir-file", lambda f: ["train", str(TINY), "--run-dir", str(f.file)], lambda f: "--run-dir"
    )
    case(
        "train-run-dir-in-file",
        lambda f: ["train", str(TINY), "--run-dir", str(f.file / "run")],
        lambda f: "--run-dir",
    )
    # -- train: --resume and --stop-at -------------------------------------------------------------------
    for kind in ("missing", "file", "dir"):
        case(
            f"train-resume-{kind}",
            lambda f, k=kind: train(f, "--resume", str(getattr(f, k))),
            lambda f, k=kind: str(getattr(f, k)),
        )
    manifests = {
        "random": lambda d: (d / "manifest.json").write_bytes(b"\xff\xfe\x00"),
        "garbage": lambda d: (d / "manifest.json").write_bytes(b"{nope"),
        "deep": lambda d: (d / "manifest.json").write_bytes(b"[" * DEEP + b"]" * DEEP),
        "shard-truncated": lambda d: _truncate(_shard(d)),
        "shard-missing": lambda d: _shard(d).unlink(),
        "shard-flipped": lambda d: _shard(d).write_bytes(_shard(d).read_bytes()[:-1] + b"\x01"),
    }
    for kind, breakage in manifests.items():
        case(
            f"train-resume-step-dir-{kind}",
            lambda f, k=kind, b=breakage: train(f, "--resume", str(f.ckpt(k, b) / "step_00000002")),
            lambda f, k=kind: str(f.root / k / "step_00000002"),
        )
        case(
            f"train-resume-root-{kind}",
            lambda f, k=kind, b=breakage: train(f, "--resume", str(f.ckpt(k, b))),
            lambda f, k=kind: "no intact checkpoint",
        )
    case("train-resume-latest-no-dir", lambda f: train(f, "--resume"), lambda f: "checkpoint.dir")
    for value in ("0", "-3", "nan", "inf"):
        case(f"train-stop-at-{value}", lambda f, v=value: train(f, "--stop-at", v), lambda f: "--stop-at")
    case("train-unknown-flag", lambda f: train(f, "--frobnicate"), lambda f: "--frobnicate")
    case("no-command", lambda f: [], lambda f: "command")
    # -- FIFOs where a file is read (issue #45, 6): one line at once, not a reader blocked forever ---------
    case(
        "train-fifo-dataset-shard",
        lambda f: train(
            f, "--set", f"data.source='{f.prepared('fifo', lambda o: _fifo(o / 'tokens-00000.arrow'))}'"
        ),
        lambda f: f"{f.root / 'fifo' / 'tokens-00000.arrow'}: is a FIFO",
    )
    case(
        "train-fifo-init-from-config",
        lambda f: train(f, "--set", f"model.init_from='{_fifo(f.root / 'hf' / 'config.json').parent}'"),
        lambda f: f"model.init_from: {f.root / 'hf' / 'config.json'}: is a FIFO",
    )
    case(
        "train-fifo-ckpt-latest",
        lambda f: train(f, "--resume", str(_fifo_latest(f.ckpt("fifo-latest")))),
        lambda f: f"{f.root / 'fifo-latest' / 'latest'}: is a FIFO",
    )
    for name in ("metrics", "timeline"):
        case(
            f"train-fifo-run-dir-{name}",
            lambda f, n=name: train(f) if _fifo(f.root / "run" / f"{n}.jsonl") else [],
            lambda f, n=name: f"--run-dir: {f.root / 'run' / n}.jsonl: is a FIFO",
        )
        case(
            f"report-fifo-{name}",
            lambda f, n=name: ["report", str(_fifo(_fifo_report_dir(f) / f"{n}.jsonl").parent)],
            lambda f, n=name: f"{f.root / 'fifo-report' / n}.jsonl: is a FIFO",
        )
    _hardening_cases(case)  # issue 45, items 8-13
    # -- prepare -----------------------------------------------------------------------------------------
    out = lambda f: str(f.root / "out")  # noqa: E731
    case(
        "prepare-glob-nothing",
        lambda f: ["prepare", str(f.root / "none*.txt"), "--out", out(f)],
        lambda f: "matches no file",
    )
    case(
        "prepare-glob-only-dirs",
        lambda f: ["prepare", str(f.dir), "--out", out(f)],
        lambda f: "matches no file",
    )
    case("prepare-out-file", lambda f: ["prepare", str(f.text), "--out", str(f.file)], lambda f: "--out")
    case(
        "prepare-out-in-file",
        lambda f: ["prepare", str(f.text), "--out", str(f.file / "x")],
        lambda f: "--out",
    )
    other = lambda f: str(f.prepared("other", lambda o: None))  # noqa: E731 - a cache of other tokens
    case(
        "prepare-out-holds-other-data",  # known only once the tokens are counted: no progress bar before it
        lambda f: ["prepare", str(f.garbage), "--out", other(f), "--no-progress"],
        lambda f: "--out",
    )
    case("prepare-no-out", lambda f: ["prepare", str(f.text)], lambda f: "--out")
    case(
        "prepare-unreadable",
        lambda f: ["prepare", str(f.unreadable), "--out", out(f)],
        lambda f: str(f.unreadable),
        root=True,
    )

    # -- report ------------------------------------------------------------------------------------------
    def run_dir(config: bytes | None, **files: bytes) -> Callable[[Files], list[str]]:
        def make(f: Files) -> list[str]:
            d = f.root / "rundir"
            d.mkdir()
            if config is not None:
                (d / "config.toml").write_bytes(config)
            for name, body in files.items():
                (d / f"{name}.jsonl").write_bytes(body)
            return ["report", str(d)]

        return make

    layout = b'[parallel]\nschedule = "1f1b"\npp = 1\n'
    for kind in ("missing", "file", "dir"):
        case(
            f"report-{kind}",
            lambda f, k=kind: ["report", str(getattr(f, k))],
            lambda f, k=kind: str(getattr(f, k)),
        )
    for kind, body in (
        ("empty", b""),
        ("partial", b'[parallel]\nschedule = "1f1b"\n'),
        ("random", b"\xff\xfe"),
        ("garbage", b"[[["),
        ("deep", b"a = " + b"[" * DEEP + b"]" * DEEP),
    ):
        case(f"report-config-{kind}", run_dir(body), lambda f: "config.toml")
    for name in ("metrics", "timeline"):
        for kind, body in (
            ("garbage", b"{oops\n{}\n"),
            ("random", b"\xff\xfe\n"),
            ("deep", b"[" * DEEP + b"]" * DEEP + b"\n{}\n"),
            ("missing-keys", b'{"step": 0}\n'),
            ("not-object", b"[1]\n"),
        ):
            case(f"report-{name}-{kind}", run_dir(layout, **{name: body}), lambda f, n=name: f"{n}.jsonl")
    case("report-step-negative", lambda f: ["report", str(f.dir), "--step", "-1"], lambda f: "--step")
    # -- checkpoint inspect / export ---------------------------------------------------------------------
    for action in ("inspect", "export"):
        extra = lambda f, a=action: [str(f.root / "model.safetensors")] if a == "export" else []  # noqa: E731
        for kind in ("missing", "file", "dir"):
            case(
                f"checkpoint-{action}-{kind}",
                lambda f, k=kind, a=action, e=extra: ["checkpoint", a, str(getattr(f, k)), *e(f)],
                lambda f, k=kind: str(getattr(f, k)),
            )
        for kind, breakage in manifests.items():
            if action == "inspect" and kind.startswith("shard"):
                continue  # inspect reads the manifest only
            case(
                f"checkpoint-{action}-{kind}",
                lambda f, k=kind, b=breakage, a=action, e=extra: [
                    "checkpoint",
                    a,
                    str(f.ckpt(k, b) / "step_00000002"),
                    *e(f),
                ],
                lambda f, k=kind: str(f.root / k / "step_00000002"),
            )
    case(
        "checkpoint-export-out-dir",
        lambda f: ["checkpoint", "export", str(f.ckpt("ok")), str(f.dir)],
        lambda f: str(f.dir),
    )
    case(
        "checkpoint-export-out-in-file",
        lambda f: ["checkpoint", "export", str(f.ckpt("ok")), str(f.file / "m.safetensors")],
        lambda f: str(f.file),
    )
    # -- MoE routing and Hugging Face MoE models (issue 43) ------------------------------------------------
    case(
        "train-moe-renormalize-dense",
        lambda f: train(f, "--set", "model.moe_renormalize=true"),
        lambda f: "model.moe_renormalize: needs model.moe_experts > 0",
    )
    case(
        "train-moe-d-ff-grouped-rows",
        lambda f: train(f, "--set", "model.moe_experts=4", "--set", "model.moe_d_ff=12"),
        lambda f: "model.moe_d_ff: moe_d_ff/tp must be a multiple of 8",
    )
    for field, value in (("router_jitter_noise", 0.1), ("mlp_only_layers", [0])):
        case(
            f"train-init-from-mixtral-{field}",
            lambda f, k=field, v=value: train(f, "--set", f"model.init_from='{_mixtral_config(f, k, v)}'"),
            lambda f, k=field: f"config.json: {k}=",
        )
    # -- plan --------------------------------------------------------------------------------------------
    plan = lambda f, *a: ["plan", str(TINY), "--devices", "4", "--device-memory", "80GB", *a]  # noqa: E731
    for kind in ("missing", "dir", "random", "garbage", "deep_toml"):
        case(
            f"plan-config-{kind}",
            lambda f, k=kind: ["plan", str(getattr(f, k)), "--devices", "4", "--device-memory", "80GB"],
            lambda f, k=kind: str(getattr(f, k)),
        )
    for flag, values in (
        ("--devices", ("0", "-4", "nan")),
        ("--device-memory", ("0", "-80GB", "nan", "inf", "1e999", "eighty", ".")),
        ("--mfu", ("0", "-0.4", "nan", "inf", "-inf", "1.5")),
        ("--top", ("0", "-1", "nan")),
        ("--device", ("tpu",)),
    ):
        for value in values:
            case(
                f"plan{flag}={value}", lambda f, fl=flag, v=value: plan(f, f"{fl}={v}"), lambda f, fl=flag: fl
            )
    # -- model families (issue 43) -----------------------------------------------------------------------
    for name, sets, expect in (
        ("family", ["model.family='gpt'"], "model.family"),
        ("rope-scaling", ["model.rope_scaling='longrope'"], "model.rope_scaling"),
        ("rope-no-original", ["model.rope_scaling='llama3'"], "model.rope_original_max_len"),
        ("rope-freq-order", ["model.rope_low_freq_factor=4.0", "model.rope_high_freq_factor=2.0"],
         "model.rope_high_freq_factor"),
        ("head-dim-odd", ["model.head_dim_override=7"], "model.head_dim_override"),
    ):  # fmt: skip
        case(
            f"train-family-{name}",
            lambda f, s=sets: train(f, *[a for x in s for a in ("--set", x)]),
            lambda f, e=expect: e,
        )
    # -- spot interruption notices (issue 49) ------------------------------------------------------------
    for key, value in (("spot_notice", "gcp"), ("spot_endpoint", "169.254.169.254"),
                       ("spot_endpoint", "file:///etc/passwd")):  # fmt: skip
        case(
            f"train-{key}-{value}",
            lambda f, k=key, v=value: train(f, "--set", f"parallel.{k}='{v}'"),
            lambda f, k=key: f"parallel.{k}: must be",
        )
    # -- scale (status and --address: issue 9's other half) ---------------------------------------------
    for value in ("0", "-2", "nan"):
        case(f"scale-dp-{value}", lambda f, v=value: ["scale", "--run", "x", "--dp", v], lambda f: "--dp")
    # -- issue 47: packed and chat data (rows: tests/unit/test_chat_data.py, which also checks nothing is
    # written) -----------------------------------------------------------------------------------------------
    case("prepare-chat-no-seq-len", lambda f: ["prepare", str(f.text), "--out", str(f.root / "o"), "--format",
                                               "chat"], lambda f: "--seq-len")
    case("prepare-pack-seq-len-0", lambda f: ["prepare", str(f.text), "--out", str(f.root / "o"), "--pack",
                                              "documents", "--seq-len", "0"], lambda f: "--seq-len")
    case(
        "prepare-chat-no-tokenizer",
        lambda f: ["prepare", str(f.text), "--out", str(f.root / "o"), "--format", "chat", "--seq-len", "64"],
        lambda f: "--tokenizer",
    )
    # -- issue 47: masked attention (document masking, sliding windows) ----------------------------------
    case(
        "train-document-masking-without-documents",
        lambda f: train(f, "--set", "data.document_masking=true"),
        lambda f: "data.document_masking: data.source 'synthetic' records no document boundaries",
    )
    case(
        "train-document-masking-not-auto",
        lambda f: train(f, "--set", 'data.document_masking="on"'),
        lambda f: 'data.document_masking: expected true, false or "auto", got \'on\'',
    )
    for key in ("model.sliding_window=4", "data.document_masking=true"):
        case(
            f"train-{key.split('=')[0]}-with-dropout",
            lambda f, k=key: train(f, "--set", k, "--set", "model.dropout=0.1"),
            lambda f, k=key: f"{k.split('=')[0]}: needs model.dropout = 0",
        )
    # -- train --dry-run (issue 48): refused as the real run would be -------------------------------------
    def finished_run(f: Files) -> list[str]:  # the run directory of a run that completed a step
        (f.root / "run").mkdir()
        (f.root / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
        return train(f, "--dry-run")

    case(
        "train-dry-run-rule",
        lambda f: train(f, "--dry-run", "--set", "parallel.tp=3"),
        lambda f: "parallel.tp",
    )
    case("train-dry-run-rerun", finished_run, lambda f: "--run-dir")
    _config_cmd_cases(case)  # issue 48 item 2: raypar config
    return cases


# -- issue 45 (items 8-13): sizes bounded before anything is enumerated or allocated; what failed only after
# the actors started, or after a traceback; what was accepted and then ignored or misread ------------------


def _manifest_text(step_dir: Path, change: Callable[[str], str]) -> None:
    path = step_dir / checkpoint.MANIFEST
    path.write_text(change(path.read_text()))


def _manifest_meta(step_dir: Path, **meta: object) -> None:
    path = step_dir / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["meta"].update({"optimizer_steps": 2, **meta})  # a resumable checkpoint but for `meta`
    path.write_text(json.dumps(manifest))


def _generate_ckpt(f: Files, tokenizer: dict) -> str:
    """A checkpoint `raypar generate` loads (a 1-layer model), recording `tokenizer`."""
    from raypar.core.config.schema import ModelConfig
    from raypar.core.model.llama import LlamaStage

    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=2, d_ff=32, vocab_size=256, seq_len=16)
    tensors = dict(LlamaStage(cfg, seed=0).named_parameters())
    specs = {n: checkpoint.ShardSpec.full(t.shape) for n, t in tensors.items()}
    meta = {"model": dataclasses.asdict(cfg), "tokenizer": tokenizer}
    return checkpoint.save(str(f.root / "gen"), 1, {"dp0.pp0.tp0": (tensors, specs)}, meta)


def _report_dir(f: Files, events: list, profile: object = None) -> list[str]:
    """A run directory whose one timeline row has `events` (and profile.json = `profile`, if given)."""
    d = f.root / "rundir"
    d.mkdir()
    (d / "config.toml").write_text('[parallel]\nschedule = "1f1b"\npp = 1\n')
    row = {"step": 0, "dp": 0, "pp": 0, "tp": 0, "actor": "dp0.pp0.tp0", "step_s": 0.5, "events": events}
    (d / "timeline.jsonl").write_text(json.dumps(row) + "\n")
    if profile is not None:
        (d / "profile.json").write_text(json.dumps(profile))
    return ["report", str(d)]


def _hardening_cases(case: Callable) -> None:
    # item 8 (and 12's seq_len, threads_per_actor): huge sizes, bounded before the planner lists layers
    for setting, key in (
        ("model.n_layers=1000000000", "model.n_layers"),
        ("model.d_model=1000000000", "model.d_model"),
        ("model.seq_len=1000000000000", "model.seq_len"),
        ("parallel.threads_per_actor=100000", "parallel.threads_per_actor"),
        ("parallel.microbatches=1000000000", "parallel.microbatches"),
        ("train.steps=1000000000000000000000", "train.steps"),  # item 13: past int64
        ("train.steps=4000000000000000000", "train.steps"),  # fits, but not times global_batch
    ):
        case(f"train-huge-{setting}", lambda f, s=setting: train(f, "--set", s), lambda f, k=key: k)
    case(
        "train-huge-max-dp",
        lambda f: train(f, "--set", "parallel.dp='auto'", "--set", "parallel.max_dp=1000000000"),
        lambda f: "actors is past any cluster",
    )
    # item 13: accepted, then ignored or reporting every step
    case(
        "train-fp8-recipe-without-fp8",
        lambda f: train(f, "--set", "train.fp8_recipe='rowwise'"),
        lambda f: "train.fp8_recipe: only means something with train.precision",
    )
    case(
        "train-hang-watchdog-tiny",
        lambda f: train(f, "--set", "train.hang_watchdog_s=1e-300"),
        lambda f: "train.hang_watchdog_s: must be 0 or at least",
    )
    case(
        "prepare-two-columns",
        lambda f: ["prepare", str(f.text), "--out", str(f.root / "out"), "--column", "prompt",
                   "--column", "response"],
        lambda f: "--column: one text column",
    )
    # item 12: refused after the actors started
    for where in ("/proc/raypar-no/logs", "FILE/sub"):
        case(
            f"train-log-dir-{where.split('/')[1]}",
            lambda f, w=where: train(
                f, "--set", "log.backends=['tensorboard']", "--set",
                f"log.dir='{w.replace('FILE', str(f.file))}'",
            ),
            lambda f: "log.dir",
        )
    case(
        "train-mlflow-uri-garbage",
        lambda f: train(f, "--set", "log.backends=['mlflow']", "--set", "log.mlflow_uri='garbage:::'"),
        lambda f: "log.mlflow_uri: MLflow has no tracking store",
    )
    # item 11's 5,000-digit step (past int()'s 4,300-digit limit, where json.loads raises ValueError), and
    # item 12's step -1 and RNG states
    broken_manifests = {
        "step-digits": lambda d: _manifest_text(d, lambda t: t.replace('"step": 2', f'"step": {"9" * 5000}')),
        "step-negative": lambda d: _manifest_meta(d)
        or _manifest_text(d, lambda t: t.replace('"step": 2', '"step": -1')),
        "rng-garbage": lambda d: _manifest_meta(d, rng={"dp0.pp0.tp0": {"cpu": "garbage!"}}),
        "rng-short": lambda d: _manifest_meta(d, rng={"dp0.pp0.tp0": {"cpu": "AAAA"}}),
        "rng-not-object": lambda d: _manifest_meta(d, rng=[1]),
    }
    rules = {"step-digits": "not a manifest", "step-negative": "'step' must be in [0, 2**63)",
             "rng-garbage": "meta.rng.dp0.pp0.tp0.cpu", "rng-short": "meta.rng.dp0.pp0.tp0.cpu",
             "rng-not-object": "meta.rng must be an object"}  # fmt: skip
    for kind, breakage in broken_manifests.items():
        case(
            f"train-resume-{kind}",
            lambda f, k=kind, b=breakage: train(f, "--resume", str(f.ckpt(k, b) / "step_00000002")),
            lambda f, k=kind: f"{f.root / k / 'step_00000002'}/manifest.json: {rules[k]}",
        )

    digits = broken_manifests["step-digits"]
    case(
        "checkpoint-inspect-step-digits",
        lambda f: ["checkpoint", "inspect", str(f.ckpt("d", digits) / "step_00000002")],
        lambda f: "manifest.json: not a manifest",
    )
    # item 11: tracebacks
    deep_index = lambda out: _index(out, b"[" * 100_000 + b"]" * 100_000)  # noqa: E731
    case(
        "train-data-uri-index-deep",
        lambda f: train(f, "--set", f"data.source='file://{f.prepared('uri-deep', deep_index)}'"),
        lambda f: "index.json: not a valid index",
    )
    case(
        "generate-tokenizer-without-json",
        lambda f: ["generate", _generate_ckpt(f, {"kind": "hf", "eos_id": 0}), "--prompt", "hi"],
        lambda f: "meta.tokenizer: a tokenizer record needs",
    )
    case(
        "generate-prompt-not-utf8",  # the bytes b"ab\xff" as Python's argv holds them (surrogateescape)
        lambda f: ["generate", _generate_ckpt(f, {"kind": "bytes", "vocab_size": 256}), "--prompt",
                   os.fsdecode(b"ab\xff")],
        lambda f: "--prompt: not valid UTF-8",
    )
    ok_events = [["forward", 0, 0.0, 0.1], ["backward", 0, 0.1, 0.3]]
    for name, events, expect in (
        ("end-1e300", [["forward", 0, 0.0, 1e300]], "every event must end by step_s"),
        ("negative-duration", [["forward", 0, 0.2, 0.1]], "0 <= start <= end"),
        ("negative-start", [["forward", 0, -5.0, 0.1]], "0 <= start <= end"),
    ):
        case(f"report-timeline-{name}", lambda f, e=events: _report_dir(f, e), lambda f, x=expect: x)
    for name, profile in (
        ("trace-events-text", {"traceEvents": "x"}),
        ("not-object", [1]),
        ("no-actors", {"traceEvents": []}),
        ("step-1e999", {"traceEvents": [], "otherData": {"actors": {"a": {"pid": 1, "steps": {"0": "x"}}}}}),
    ):
        case(
            f"report-profile-{name}",
            lambda f, p=profile: _report_dir(f, ok_events, p),
            lambda f: "profile.json: not a profile",
        )


# -- issue 48 item 2: `raypar config` refuses what resolving a config for `raypar train` refuses -------------


def _config_cmd_cases(case: Callable) -> None:
    def config(*args: str) -> Callable[[Files], list[str]]:
        return lambda f: ["config", str(TINY), *args]

    case("config-unknown-section", config("--section", "paint"), lambda f: "--section")
    for kind in ("missing", "dir", "garbage"):
        case(
            f"config-file-{kind}",
            lambda f, k=kind: ["config", str(getattr(f, k))],
            lambda f, k=kind: str(getattr(f, k)),
        )
    case("config-rule", config("--set", "parallel.tp=3"), lambda f: "parallel.tp: must")
    case("config-unknown-key", config("--set", "model.colour=1"), lambda f: "model.colour")
    garbage = lambda out: _index(out, b"{not json")  # noqa: E731
    case(  # a prepared dataset's vocabulary is read as `raypar train` reads it
        "config-data-index-garbage",
        lambda f: ["config", "--set", f"data.source='{f.prepared('cfg', garbage)}'"],
        lambda f: "data.source",
    )


@pytest.mark.parametrize("argv, expect", _cases())
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, no_ray, argv, expect):
    files = Files(tmp_path)
    args = argv(files)
    rc = cli.main(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, (args, rc, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("raypar: "), err[-2000:]
    assert expect(files) in lines[0], (expect(files), lines[0])
    assert "Traceback" not in err
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_resume_control_reaches_the_actors(tmp_path, no_actors):
    """The control of the train-resume-step-*/rng-* cases: the same checkpoint, unbroken, passes every check
    (and so each of those is refused for what was broken)."""
    from tests.support.runs import ACTORS_START, ActorsStarted

    files = Files(tmp_path)
    with pytest.raises(ActorsStarted, match=ACTORS_START):
        cli.main(train(files, "--resume", str(files.ckpt("ok", _manifest_meta) / "step_00000002")))
