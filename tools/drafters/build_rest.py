"""Build the REST datastore shipped for SmolLM2: every answer of the self-distillation corpus
(greedy and sampled; the corpus never contains Spec-Bench questions) as one suffix array.

    python -m tools.drafters.build_rest --corpus assets/corpus/smollm2 \\
        --out assets/text_drafters/smollm2/rest/datastore.safetensors

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
    ap.add_argument("--corpus", default="assets/corpus/smollm2")
    ap.add_argument("--out", default="assets/text_drafters/smollm2/rest/datastore.safetensors")
    args = ap.parse_args(argv)
    start = time.time()
    rest = Rest.from_corpus([Path(args.corpus) / CORPUS_FILE])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rest.save(out)
    info = {"what": "REST datastore: token ids of every answer (greedy + sampled) of the SmolLM2 "
                    "self-distillation corpus, -1 between answers, and their suffix array",
            "corpus": args.corpus, "tokens": len(rest.datastore), "seconds": round(time.time() - start, 1),
            "target": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "command": f"python -m tools.drafters.build_rest --corpus {args.corpus} --out {args.out}"}
    (out.parent / "datastore.json").write_text(json.dumps(info, indent=1) + "\n")
    print(info)


if __name__ == "__main__":
    main()
