"""Text corpora to sliding-window batches: loading, a token cache, the windows, a DataModule.

The path of a corpus, stage by stage:

1. `resolve_source`: a file, directory, glob or hub dataset name becomes a `CorpusSpec`
   (what to read, and an identity that changes when the data does).
2. `load_documents`: Hugging Face `datasets` reads it as documents, one string each (a text
   file is one document; a json/jsonl record or a parquet row is one document). Plain-text
   files, the embedded corpus's included, are read without it, the same documents
   (`TextFiles`, `documents.py`).
3. `tokenize_corpus`: tiktoken encodes the documents in parallel (`datasets.map`,
   `num_proc` processes; threads for plain text) and writes one flat token file per split,
   documents joined by `<|endoftext|>`, under a cache key of source identity, tokenizer and
   split.
4. `SlidingWindowDataset`: the book's `GPTDatasetV1` windows read straight from a memmap
   of that file, so building one costs no memory and no time whatever the corpus size.
5. `ResumableSampler` and `GPTDataModule`: shuffled by (seed, epoch), one share per DDP
   rank, and able to resume mid-epoch on exactly the windows not yet seen.

The module's settings come in three parts (`settings.py`): the `Corpus` (stages 1-3), the
`Windows` (stage 4) and the `Loader` (stage 5).
"""


from gptmini.data.corpus import EMBEDDED_CORPUS, CorpusSpec, default_cache_dir, resolve_source
from gptmini.data.documents import load_documents
from gptmini.data.module import GPTDataModule
from gptmini.data.settings import Corpus, Loader, Windows
from gptmini.data.tokens import TokenCache, tokenize_corpus
from gptmini.data.vocab import fit_tokenizer
from gptmini.data.windows import (
    ResumableSampler,
    SlidingWindowDataset,
    create_dataloader,
    permute,
)

__all__ = [
    "EMBEDDED_CORPUS",
    "Corpus",
    "CorpusSpec",
    "GPTDataModule",
    "Loader",
    "ResumableSampler",
    "SlidingWindowDataset",
    "TokenCache",
    "Windows",
    "create_dataloader",
    "default_cache_dir",
    "fit_tokenizer",
    "load_documents",
    "permute",
    "resolve_source",
    "tokenize_corpus",
]
