"""The web corpora (data/openwebtext, data/fineweb): a hub dataset or local files -> whole-document train/val ->
core/data/corpus.py's tokenizer -> encoding in datasets' worker processes -> shards -> meta.json.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import time
from pathlib import Path

import numpy as np

from core.data.corpus import check_tokenizer_spec, document_marks, make_tokenizer
from core.data.tokenizer import Tokenizer, tokenizer_from_meta
from core.data.writer import ShardWriter, script_out_dir, token_dtype, write_meta
from core.errors import UserError, first_line


@dataclasses.dataclass
class WebPrepareConfig:
    data_files: str | None = None    # local parquet/json/jsonl/txt files with a `text` column (comma-separated,
                                     # globs allowed; each .txt file is one document); default: the hub dataset
    out_dir: str | None = None       # default: the prepare.py script's own folder
    tokenizer: str = "gpt2"          # gpt2 | bpe:VOCAB (trained on the train split) | a transformers folder or
                                     # tokenizer.json; as data/text/prepare.py's --tokenizer, without char
    val_fraction: float = 0.0005     # of documents, held out as the val split
    seed: int = 2357                 # of the train/val split
    num_proc: int = max(1, (os.cpu_count() or 2) // 2)  # worker processes for download and tokenization
    shard_tokens: int = 100_000_000  # tokens per .bin shard: 200 MB of uint16
    cache_dir: str | None = None     # Hugging Face datasets cache; default ~/.cache/huggingface/datasets

    def validate(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"val_fraction must be between 0 and 1, got {self.val_fraction}")
        if self.num_proc < 1:
            raise UserError(f"num_proc must be at least 1, got {self.num_proc}")
        if self.shard_tokens < 1:
            raise UserError(f"shard_tokens must be at least 1, got {self.shard_tokens}")
        # No char: its vocabulary is every character of the corpus, known only after a whole pass.
        check_tokenizer_spec(self.tokenizer, char=False)


_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text"}


def load_text_dataset(hub_name: str, hub_config: str | None, data_files: str | None, num_proc: int,
                      cache_dir: str | None):
    """A datasets.Dataset with a `text` column: from local `data_files`, else from the Hugging Face hub."""
    if data_files is not None:
        files = []
        for pattern in (p.strip() for p in data_files.split(",") if p.strip()):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise UserError(f"--data_files: no file matches '{pattern}'")
            files += matches
        kinds = {_BUILDERS.get(Path(f).suffix.lower()) for f in files}
        if None in kinds or len(kinds) != 1:
            raise UserError(f"--data_files must all be one kind of {', '.join(_BUILDERS)}, got {data_files}")
        builder = kinds.pop()
        extra = {"sample_by": "document"} if builder == "text" else {}
        source, args = data_files, dict(path=builder, data_files=files, **extra)
    else:
        source, args = hub_name + (f" ({hub_config})" if hub_config else ""), dict(path=hub_name, name=hub_config)
    import datasets  # here: importing it takes seconds, and only the web corpora need it

    try:
        ds = datasets.load_dataset(**args, split="train", num_proc=num_proc, cache_dir=cache_dir)
    except Exception as e:  # network, hub, or file format: one line, and how to go local
        raise UserError(f"could not load {source}: {type(e).__name__}: {first_line(e)}; "
                        f"to use local files pass --data_files=a.parquet,b.parquet") from None
    if "text" not in ds.column_names:
        raise UserError(f"{source} has columns {ds.column_names}, but no 'text' column")
    return ds


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(meta_json: str) -> tuple[Tokenizer, list[int], list[int]]:
    """The tokenizer and the ids put before and after each document, built once per worker process."""
    tok = tokenizer_from_meta(json.loads(meta_json))
    prefix, suffix, joiner = document_marks(tok)
    return tok, prefix, suffix + joiner


def _tokenize_batch(batch: dict, meta_json: str) -> dict:
    # In datasets' workers, which rebuild the tokenizer once from its metadata: a string, part of datasets' cache
    # fingerprint, so another tokenizer never reuses a cached encoding. Each document gets its marks, since the
    # shuffled split puts any document next to any other. A plain loop: threads on num_proc processes only contend.
    tok, before, after = _worker_tokenizer(meta_json)
    ids = [before + tok.encode(text) + after for text in batch["text"]]
    return {"ids": ids, "len": [len(d) for d in ids]}


def write_split(part, tok: Tokenizer, out_dir: Path, split: str, cfg: WebPrepareConfig) -> int:
    """The documents of `part` tokenized in cfg.num_proc workers, then into `{split}_*.bin` shards -> token count."""
    import datasets
    import pyarrow.compute as pc
    from tqdm import tqdm

    dtype = token_dtype(tok)
    features = datasets.Features({"ids": datasets.List(datasets.Value(np.dtype(dtype).name)),
                                  "len": datasets.Value("int64")})
    tokenized = part.map(_tokenize_batch, batched=True, remove_columns=part.column_names, features=features,
                         fn_kwargs={"meta_json": json.dumps(tok.meta(), sort_keys=True)},
                         num_proc=min(cfg.num_proc, max(1, len(part))), desc=f"tokenizing {split}").with_format("arrow")
    with ShardWriter(out_dir, split, cfg.shard_tokens, dtype) as writer, \
            tqdm(total=pc.sum(tokenized["len"]).as_py() or 0, unit="tok", unit_scale=True, desc=f"writing {split}",
                 disable=None) as bar:
        for table in tokenized.iter(batch_size=4096):
            ids = table.column("ids").combine_chunks().flatten().to_numpy()
            writer.write(ids)
            bar.update(ids.size)
    return writer.num_tokens


def prepare_web_corpus(cfg: WebPrepareConfig, hub_name: str, hub_config: str | None, script_file: str) -> dict:
    """The module's pipeline for one corpus; prints tokens/s."""
    out_dir = script_out_dir(cfg.out_dir, script_file)
    trained = cfg.tokenizer.startswith("bpe:")
    tok = None if trained else make_tokenizer(cfg.tokenizer)  # a missing BPE file or bad folder: before a download
    ds = load_text_dataset(hub_name, hub_config, cfg.data_files, cfg.num_proc, cfg.cache_dir)
    if len(ds) < 2:
        raise UserError(f"the source has {len(ds)} document(s); a train and a val split need at least 2")
    start = time.perf_counter()
    splits = ds.train_test_split(test_size=cfg.val_fraction, seed=cfg.seed, shuffle=True)
    if trained:  # streamed: a batch of the train split's texts at a time from its memory-mapped Arrow files
        train = splits["train"].select_columns(["text"])
        tok = make_tokenizer(cfg.tokenizer, (text for batch in train.iter(batch_size=1024) for text in batch["text"]))
    meta = {"source": cfg.data_files or (hub_name + (f":{hub_config}" if hub_config else ""))}
    for split, part in (("train", splits["train"]), ("val", splits["test"])):
        meta[f"{split}_tokens"] = write_split(part, tok, out_dir, split, cfg)
        meta[f"{split}_documents"] = len(part)
    meta = write_meta(out_dir, tok, meta)
    seconds = time.perf_counter() - start
    print(f"{meta['tokenizer']} vocab_size {tok.vocab_size}: wrote {meta['train_tokens']:,} train and "
          f"{meta['val_tokens']:,} val tokens ({meta['dtype']}) to {out_dir} in {seconds:.1f}s: "
          f"{(meta['train_tokens'] + meta['val_tokens']) / seconds:,.0f} tokens/s")
    return meta
