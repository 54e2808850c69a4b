"""``flashmm generate``: answer one text prompt with speculative decoding.

    flashmm generate "Write a haiku about rain." --model DIR --drafter prompt_lookup

The model is any causal LM directory (AutoModelForCausalLM) or a vision-language model
directory (AutoModelForImageTextToText; the prompt goes in without media). The prompt is
wrapped in the tokenizer's chat template as one user turn (``--raw``: tokenized as given). The
answer streams to stdout as each verification commits tokens (transformers' TextStreamer);
the stats (new tokens, tokens/s, tau, accepted drafted tokens per step) go to stderr.
"""
from __future__ import annotations

import os
import sys
import time

from .cli_options import (EXIT_OK, add_decoding_options, check_decoding_options, drafter_arg, error, generation_kwargs,
                          spec_kwargs, torch_dtype)


def add_generate_command(commands) -> None:
    gen = commands.add_parser(
        "generate", help="answer a text prompt (streams the answer, then the stats)",
        description="Generate text from a prompt with a causal LM (or a vision-language model, without media) "
                    "and a drafter. The answer streams to stdout as tokens commit; the stats go to stderr. "
                    "Exit status: 0 done, 2 usage or setup error.")
    gen.add_argument("prompt", help="the user message (or, with --raw, the exact text to continue)")
    gen.add_argument("--raw", action="store_true", help="tokenize the prompt as given, without the chat template")
    add_decoding_options(gen, max_new_tokens=256)
    gen.set_defaults(run=run_generate)


def load_text_model(directory: str, device=None, dtype=None):
    """(model, tokenizer, processor or None) from a local directory: a vision-language model
    (with its processor) when its config is one, else a causal LM (with its tokenizer). eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from .pipelines import load_model, load_processor

    local = os.path.isdir(directory)
    config = AutoConfig.from_pretrained(directory, local_files_only=local)
    if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        processor = load_processor(directory)
        return load_model(directory, device=device, dtype=dtype), processor.tokenizer, processor
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=local, **kwargs)
    if device is not None:
        model = model.to(device)
    return model.eval(), AutoTokenizer.from_pretrained(directory, local_files_only=local), None


def prompt_inputs(tokenizer, processor, prompt: str, raw: bool) -> dict:
    """Tokenized prompt {input_ids, attention_mask} [1, T]: one user turn through the chat
    template (the tokenizer's, else the processor's), or the text as given with ``raw`` or when
    neither has a template. A rendered template already holds its special tokens, so none are added."""
    if not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    elif not raw and getattr(processor, "chat_template", None):
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                                             tokenize=False, add_generation_prompt=True)
    else:
        return dict(tokenizer(prompt, return_tensors="pt"))
    return dict(tokenizer(text, return_tensors="pt", add_special_tokens=False))


def format_stats(stats) -> str:
    """One line of GenerationStats: new tokens, time, tokens/s, target forwards, tau, accepted histogram."""
    line = (f"{stats.new_tokens} new tokens in {stats.total_seconds:.2f} s ({stats.tokens_per_second:.1f} tok/s), "
            f"{stats.target_forwards} target forwards")
    if stats.verify_steps:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(stats.accepted_hist.items()))
        line += (f"; tau {stats.tau:.2f} over {stats.verify_steps} verification steps; "
                 f"accepted drafted tokens per step (count:steps) {hist}")
    return line


def run_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from ..drafters.resolve import resolve_drafter
    from ..engine.api import wrap
    from .pipelines import plain_generate, plain_stats

    problem = check_decoding_options(args)
    if problem:
        return error("generate", problem)
    try:
        model, tokenizer, processor = load_text_model(args.model, device=args.device, dtype=torch_dtype(args))
        drafter = resolve_drafter(drafter_arg(args.drafter), device=model.device, allow_untrained=args.allow_untrained)
        spec_model = None
        if drafter is not None:
            spec_model = wrap(model, drafter, processor=processor, attention=args.attention, linear=args.linear,
                              cuda_graphs=args.cuda_graphs, allow_untrained=args.allow_untrained,
                              **spec_kwargs(args))
    except (OSError, ValueError, TypeError, ImportError) as err:
        return error("generate", f"cannot set up the model / drafter: {type(err).__name__}: {err}")
    inputs = {k: v.to(model.device) for k, v in prompt_inputs(tokenizer, processor, args.prompt, args.raw).items()}
    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(args.seed)
    generation = dict(generation_kwargs(args), streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    start = time.perf_counter()
    try:
        if spec_model is not None:
            spec_model.generate(**inputs, **generation, generator=generator)
            stats = spec_model.last_stats
        else:
            with torch.no_grad():
                out = plain_generate(model, inputs, generation, generator)
            stats = plain_stats(out.shape[1] - inputs["input_ids"].shape[1], time.perf_counter() - start)
    except (ValueError, TypeError) as err:  # settings generate refuses (checked before anything is decoded)
        return error("generate", f"{type(err).__name__}: {err}")
    sys.stdout.flush()
    print(f"flashmm generate: {format_stats(stats)}", file=sys.stderr)
    return EXIT_OK
