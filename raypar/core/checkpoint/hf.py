"""Hugging Face weights in and out: config.json <-> ModelConfig, sliced loading, export, for every family.

What is a family's own (config.json fields both ways, tensor names) is its `hf` mapping
(raypar.core.model.stage.HFMapping, e.g. raypar.core.model.llama.hf); config.json's `model_type` picks the
family (raypar.core.model.families.for_model_type). This module reads and writes the files.

Loading reads each actor's own slice of each tensor straight from the safetensors files
(`safe_open(...).get_slice`), memory-mapped: no process ever holds the whole model.

    fields = model_fields(path)            # ModelConfig fields; ConfigError names an unsupported field
    load_stage(stage, path)                # fill one stage (any stage, any tp rank) from the files
    export(ckpt_uri, out_dir)              # raypar checkpoint -> config.json + model*.safetensors
                                           # (+ the run's tokenizer, its EOS named, if it had one)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

from raypar.core.checkpoint.format import OPTIM_PREFIX, CheckpointError
from raypar.core.checkpoint.reader import CheckpointReader, check_memory, model_config, read_bytes_peak
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import ModelConfig
from raypar.core.data.corpus import file_inside
from raypar.core.data.tokenizer import ByteTokenizer, HFTokenizer, from_record
from raypar.core.model import families
from raypar.core.model.stage import Stage
from raypar.core.plain_files import NotRegularFile, read_regular, refuse_unless_regular

CONFIG, INDEX = "config.json", "model.safetensors.index.json"
MAX_SHARD_BYTES = 2 * 2**30  # per exported file; a larger model is split into files with an index
# Model fields config.json implies that a run may still change: HF's MoE routes dropless, a run may train
# with a capacity factor (the user's value wins over the file's).
RUN_MAY_SET = frozenset({"moe_capacity_factor"})
ROUTING_BIAS = ".mlp.expert_bias"  # raypar.core.model.moe's aux-loss-free balancing state


# -- config ---------------------------------------------------------------------------------------------


def _read_config(path: str) -> dict[str, Any]:
    file = Path(path) / CONFIG
    try:
        # a Hugging Face cache links its files to blobs: followed; a FIFO is refused, not waited on
        hf = json.loads(read_regular(file, "a model's config.json", follow_symlinks=True).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"model.init_from: {file} not found (a Hugging Face model directory)") from None
    except NotRegularFile as err:
        raise ConfigError(f"model.init_from: {err}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ConfigError(f"model.init_from: {file}: cannot read: {str(err)[:120]}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.init_from: {file}: must be a JSON object, got {type(hf).__name__}")
    return hf


def model_fields(path: str) -> dict[str, Any]:
    """ModelConfig fields from `path`/config.json, by the family its `model_type` names. Anything that
    family's blocks would compute differently is refused, naming the field."""
    hf = _read_config(path)
    where = f"model.init_from: {Path(path) / CONFIG}"
    return families.for_model_type(hf.get("model_type"), where).hf.model_fields(hf, where)


# -- weights in -----------------------------------------------------------------------------------------


class HFWeights:
    """The tensors of a Hugging Face model directory, one safetensors file or several (with or without
    model.safetensors.index.json); `read_slice` reads a rectangle of one tensor and nothing else."""

    def __init__(self, path: str):
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            self.file_of = {
                name: file_inside(self.path, file, f"model.init_from: {index}: weight_map[{name!r}]")
                for name, file in _weight_map(index).items()
            }
        else:
            self.file_of = {}
            for file in sorted(self.path.glob("*.safetensors")):
                self.file_of.update(dict.fromkeys(_header(file), file))
        if not self.file_of:
            raise ConfigError(f"model.init_from: {self.path} holds no *.safetensors weights")
        self._open: dict[Path, Any] = {}

    def shapes(self) -> dict[str, list[int]]:
        """Every tensor's shape, from the files' headers (no tensor is read); ConfigError naming a file
        that is missing, truncated or not safetensors, or a tensor the index puts in a file without it."""
        found: dict[Path, dict[str, list[int]]] = {}
        for file in sorted(set(self.file_of.values())):
            found[file] = _header(file)
        shapes = {}
        for name, file in self.file_of.items():
            if name not in found[file]:
                raise ConfigError(f"model.init_from: {file} has no tensor {name} (its index says it has)")
            shapes[name] = found[file][name]
        return shapes

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def read_slice(
        self, name: str, global_shape: tuple[int, ...], offsets: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        if name not in self.file_of:
            raise KeyError(f"{self.path}: no tensor {name}")
        file = self.file_of[name]
        if file not in self._open:
            self._open[file] = safe_open(file, "pt")
        view = self._open[file].get_slice(name)
        if tuple(view.get_shape()) != tuple(global_shape):
            raise ValueError(
                f"{file}: {name} has shape {view.get_shape()}, the model expects {list(global_shape)}"
            )
        return view[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))]


def _weight_map(index: Path) -> dict[str, Any]:
    """The weight_map of a model.safetensors.index.json; ConfigError naming the file if it has none."""
    try:
        body = read_regular(index, "a weight index", follow_symlinks=True)
        weight_map = json.loads(body.decode("utf-8")).get("weight_map")
    except (OSError, ValueError, RecursionError, AttributeError) as err:  # ValueError: JSON, UTF-8, FIFO
        raise ConfigError(f"model.init_from: {index}: not a weight index: {str(err)[:80]}") from None
    if not isinstance(weight_map, dict):
        raise ConfigError(f"model.init_from: {index}: weight_map must map tensor names to files")
    return weight_map


def _header(file: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header (also checks that the file holds every byte
    the header promises); ConfigError naming the file."""
    try:
        refuse_unless_regular(file, "a weight file", follow_symlinks=True)  # safe_open would wait on a FIFO
        with safe_open(file, "pt") as f:
            return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except FileNotFoundError:
        raise ConfigError(f"model.init_from: {file}: not found") from None
    except NotRegularFile as err:
        raise ConfigError(f"model.init_from: {err}") from None
    except (OSError, SafetensorError) as err:
        raise ConfigError(f"model.init_from: {file}: not a readable safetensors file ({err})") from None


def check_weights(cfg: ModelConfig) -> None:
    """Check `cfg.init_from`'s files before any actor starts: every tensor the model needs (a stage
    holding every layer) is there with the shape it needs, read from the headers alone. What `load_stage`
    would find on every actor after start-up, found once, up front; ConfigError naming file and tensor."""
    shapes = HFWeights(cfg.init_from).shapes()
    with torch.device("meta"):  # shapes without memory: the model may not fit this machine
        model = families.build_stage(cfg, init=False)
    hf_name = families.family(cfg).hf.hf_name
    for name, (global_shape, _) in model.shard_specs().items():
        source = hf_name(model.init_source(name))
        if source not in shapes:
            raise ConfigError(f"model.init_from: {cfg.init_from} has no tensor {source}")
        if tuple(shapes[source]) != tuple(global_shape):
            raise ConfigError(
                f"model.init_from: {cfg.init_from}: {source} has shape {shapes[source]}, config.json "
                f"implies {list(global_shape)}"
            )


@torch.no_grad()
def load_stage(stage: Stage, path: str) -> None:
    """Copy this stage's shard of every parameter from the HF model at `path` (any stage and tp rank). A
    tied head reads the embedding (HF files of tied models have no lm_head)."""
    weights = HFWeights(path)
    hf_name = families.family(stage.cfg).hf.hf_name
    for name, (global_shape, offsets) in stage.shard_specs().items():
        param = stage.get_parameter(name)
        source = hf_name(stage.init_source(name))
        param.copy_(weights.read_slice(source, global_shape, offsets, tuple(param.shape)))


# -- weights out ----------------------------------------------------------------------------------------


def export(
    ckpt_uri: str,
    out_dir: str,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    say: Callable[[str], None] | None = None,
) -> str:
    """Write `out_dir`/config.json and model.safetensors (or model-0000k-of-0000n.safetensors with an
    index when larger than `max_shard_bytes`) that the family's `*ForCausalLM.from_pretrained` loads, and the
    run's tokenizer for AutoTokenizer (`say` gets a line where the run had none: synthetic data). Tensors are
    read one at a time; the directory is built aside and renamed into place."""
    reader = CheckpointReader(ckpt_uri)
    cfg = model_config(reader)  # agrees with the tensors' shapes
    model, mapping = dataclasses.asdict(cfg), families.family(cfg).hf
    refusal = mapping.export_refusal(model)
    if refusal is not None:
        raise CheckpointError(
            f"{reader._where}: {refusal} (export the raypar tensors with --format safetensors)"
        )
    names = [n for n in reader.names() if not n.startswith(OPTIM_PREFIX)]
    for name in [n for n in names if n.endswith(ROUTING_BIAS)]:  # state HF's routers have no place for
        if reader.read_full(name).any():
            raise CheckpointError(
                f"{reader._where}: {name} is not zero: Hugging Face's routers route without a bias"
            )
        names.remove(name)
    files: list[list[str]] = [[]]
    size, largest = 0, 0
    for name in names:
        nbytes = math.prod(reader.global_shape(name)) * reader.dtype(name).itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
        largest = max(largest, size)
    # One file's tensors in memory, a copy as safetensors lays them out, and one read's transients.
    need = 2 * largest + read_bytes_peak(reader)
    check_memory(need, f"exporting {ckpt_uri}")
    tokenizer = _tokenizer(reader)
    if tokenizer is None and say is not None:
        say(f"{ckpt_uri}: the run recorded no tokenizer (synthetic data): the export has none")
    out = Path(out_dir).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: already exists and is not an empty directory")
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        _write_hf_dir(reader, staging, files, model, tokenizer, mapping)
        os.rename(staging, out)
    except OSError as err:  # a read-only or full disk: the output is bad, not the checkpoint
        raise CheckpointError(f"{out}: cannot write: {err.strerror or err}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(out)


def _tokenizer(reader: Any) -> HFTokenizer | ByteTokenizer | None:
    """The run's tokenizer as its checkpoint recorded it (None: none, the run's data was synthetic);
    CheckpointError naming the manifest if the record is damaged."""
    record = reader.meta.get("tokenizer")
    if isinstance(record, dict) and record.get("kind") == "bytes":
        return ByteTokenizer()
    if not isinstance(record, dict) or not record.get("json"):
        return None
    try:
        tok = from_record(record)
    except (ConfigError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{reader._where}: meta.tokenizer is not a tokenizer record: {err}") from None
    if tok.eos_token is None:
        raise CheckpointError(f"{reader._where}: meta.tokenizer.eos_id {tok.eos_id} is not in its vocabulary")
    return tok


def _write_hf_dir(
    reader: Any,
    staging: Path,
    files: list[list[str]],
    model: dict[str, Any],
    tokenizer: HFTokenizer | ByteTokenizer | None,
    mapping: Any,
) -> None:
    weight_map, total = {}, 0
    for k, group in enumerate(files):
        file = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" if len(files) > 1 else "model.safetensors"
        tensors = {mapping.hf_name(n): reader.read_full(n).contiguous() for n in group}
        # written by this process (the umask's mode, as every other file here), not save_file's 0600
        (staging / file).write_bytes(safetensors.torch.save(tensors, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors  # one file's tensors in memory at a time
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / INDEX).write_text(json.dumps(index, indent=1))
    config = mapping.config_json(model)
    if isinstance(tokenizer, ByteTokenizer):  # no EOS: byte-level documents are joined by "\n\n"
        (staging / "tokenizer.json").write_text(tokenizer.hf_json())
        (staging / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=1)
        )
    elif tokenizer is not None:
        # The EOS the documents were joined by, named where transformers looks: AutoTokenizer's eos_token
        # (tokenizer.json alone names no EOS) and the model's, which generate() stops at.
        config["eos_token_id"] = tokenizer.eos_id
        special = {"eos_token": tokenizer.eos_token}
        (staging / "tokenizer.json").write_text(tokenizer.text)
        (staging / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}, indent=1)
        )
        (staging / "special_tokens_map.json").write_text(json.dumps(special, indent=1))
    (staging / CONFIG).write_text(json.dumps(config, indent=1))
