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
from raypar.core.checkpoint import format as checkpoint
from raypar.core.config.schema import Config
from raypar.core.data import datasets as data
from tests.support.runs import TINY

DEEP = 50_000  # nesting that overflows Python's recursion limit in any recursive parser
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
ZERO_OK = {
    "train.warmup_steps", "train.seed", "train.max_failures", "train.min_lr", "train.weight_decay",
    "train.beta1", "train.beta2", "train.grad_clip", "checkpoint.every", "parallel.max_dp",
    "model.dropout", "model.moe_experts", "model.moe_aux_loss_coef",
    "model.moe_capacity_factor", "model.moe_bias_update_rate", "model.moe_shared_experts",  # 0: dropless, off
    "train.eval_every", "data.val_fraction",  # 0: no validation
    "parallel.zero",  # 0: no sharding
    "parallel.dp_shard",  # 0: all dp replicas shard the state
    "train.hang_watchdog_s",  # 0: a fifth of parallel.timeout_s
    "parallel.placement_timeout_s",  # 0: parallel.timeout_s
    "parallel.compression_start_step",
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
    return cases


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
