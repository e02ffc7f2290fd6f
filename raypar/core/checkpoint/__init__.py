"""Checkpoints: the storage format, writing and publishing (`format`), and reading back (`reader`). What
callers use is here (`checkpoint.publish`, `checkpoint.CheckpointReader`); Hugging Face weights in and out
are `raypar.core.checkpoint.hf`, imported by name.
"""

from raypar.core.checkpoint.format import (
    FS_ERRORS,
    LATEST,
    MANIFEST,
    OPTIM_PREFIX,
    STEP_RE,
    CheckpointError,
    ShardSpec,
    SpecialFileError,
    begin,
    discard,
    join_uri,
    list_checkpoints,
    load_manifest,
    publish,
    read_bytes,
    resolve,
    resolve_fs,
    save,
    shard_key,
    snapshot,
    step_name,
    subdirs,
    write_bytes,
    write_shard,
)
from raypar.core.checkpoint.reader import (
    CheckpointReader,
    available_memory,
    check_memory,
    check_resumable,
    decode_bytes,
    export,
    inspect,
    model_bytes,
    model_config,
    newest_intact,
    read_bytes_peak,
    routing_biases,
    verify,
)

__all__ = [
    "FS_ERRORS", "LATEST", "MANIFEST", "OPTIM_PREFIX", "STEP_RE", "CheckpointError", "CheckpointReader",
    "ShardSpec", "SpecialFileError", "available_memory", "begin", "check_memory", "check_resumable",
    "decode_bytes", "discard", "export", "inspect", "join_uri", "list_checkpoints", "load_manifest",
    "model_bytes", "model_config", "newest_intact", "publish", "read_bytes", "read_bytes_peak", "resolve",
    "resolve_fs", "routing_biases", "save", "shard_key", "snapshot", "step_name", "subdirs", "verify",
    "write_bytes", "write_shard",
]
