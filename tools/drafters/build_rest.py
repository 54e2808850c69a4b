"""Build the REST datastore shipped for SmolLM2: every answer of the self-distillation corpus
(greedy and sampled; the corpus never contains Spec-Bench questions) as one suffix array.

    python -m tools.drafters.build_rest --corpus assets/corpus/smollm2 \\
        --out assets/text_drafters/smollm2/rest/datastore.safetensors
    python -m tools.drafters.build_rest --corpus assets/corpus/smollm2 assets/corpus/smollm2_gpu --compact \\
        --out assets/text_drafters/smollm2/rest/datastore_large.safetensors

(the second: both corpora, 5.8M tokens, stored compact — the tokens alone, int32, 23 MB; the suffix
array is built on first load, ~25 s, and cached.)

Use: ``flashmm.wrap(model, Rest(datastore="assets/text_drafters/smollm2/rest/datastore.safetensors"))``
or ``SuffixDecoding(datastore=...)``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from flashmm.drafters.rest import Rest
from flashmm.train.corpus import CORPUS_FILE


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", nargs="+", default=["assets/corpus/smollm2"])
    ap.add_argument("--out", default="assets/text_drafters/smollm2/rest/datastore.safetensors")
    ap.add_argument("--compact", action="store_true", help="store the tokens alone (Datastore.save(compact=True))")
    args = ap.parse_args(argv)
    start = time.time()
    rest = Rest.from_corpus([Path(corpus) / CORPUS_FILE for corpus in args.corpus])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rest.save(out, compact=args.compact)
    info = {"what": "REST datastore: token ids of every answer (greedy + sampled) of the SmolLM2 "
                    "self-distillation corpus, -1 between answers, and "
                    + ("no suffix array (compact: built on first load and cached)" if args.compact else
                       "their suffix array"),
            "corpus": args.corpus if len(args.corpus) > 1 else args.corpus[0], "tokens": len(rest.datastore),
            "seconds": round(time.time() - start, 1), "target": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "command": f"python -m tools.drafters.build_rest --corpus {' '.join(args.corpus)}"
                       + " --compact" * args.compact + f" --out {args.out}"}
    out.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
    print(info)


if __name__ == "__main__":
    main()
