"""Token data: prepare text into Arrow shards (`preparing`), read them memory-mapped (`reading`), and sample
batches by global index (`sampling`). What callers use is here:

    ds = data.open_dataset(cfg.data, cfg.model)
    sampler = data.GlobalSampler(ds.num_samples, cfg.train.global_batch, cfg.train.seed)
    for mb in data.replica_microbatch_ids(dp_rank, dp, cfg.train.global_batch, cfg.microbatch_size):
        inputs, targets = data.microbatch(ds, sampler, step, mb, cfg.microbatch_size)  # int64 [mb, T]

Where documents come from (raypar.core.data.corpus), tokenizers (.tokenizer), conversations (.chat), packed
documents (.packed), document masks (.documents) and copies from object storage (.remote) are modules of
their own, imported by name.
"""

from raypar.core.data.preparing import (
    INDEX,
    TOKENIZER,
    open_tokenizer,
    prepare,
    prepared_vocab_size,
    read_index,
    stdlib_globs,
    tokenizer_record,
)
from raypar.core.data.reading import (
    Dataset,
    SampleRange,
    SyntheticDataset,
    TokenDataset,
    open_dataset,
    open_datasets,
)
from raypar.core.data.sampling import (
    GlobalSampler,
    check_eval,
    eval_microbatch,
    microbatch,
    replica_microbatch_ids,
)

__all__ = [
    "INDEX", "TOKENIZER", "Dataset", "GlobalSampler", "SampleRange", "SyntheticDataset", "TokenDataset",
    "check_eval", "eval_microbatch", "microbatch", "open_dataset", "open_datasets", "open_tokenizer",
    "prepare", "prepared_vocab_size", "read_index", "replica_microbatch_ids", "stdlib_globs",
    "tokenizer_record",
]
