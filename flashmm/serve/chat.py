"""The prompt a caption item gets: the processor's chat template with one placeholder per image
(or video), or the LLaVA-1.5 form where the template cannot place them."""
from __future__ import annotations

import warnings


def text_kwargs(processor, text: str) -> dict:
    """Processor keyword arguments for ``text`` (PyTorch tensors; a chat template that already
    wrote the BOS token must not get a second one)."""
    bos = getattr(getattr(processor, "tokenizer", None), "bos_token", None)
    kwargs = dict(return_tensors="pt")
    if bos and text.startswith(bos):
        kwargs["add_special_tokens"] = False
    return kwargs


def chat_prompt(processor, text: str, images: int = 0, videos: int = 0, frame_labels: bool = False) -> str:
    """The prompt text with one image placeholder per image and one video placeholder per video.

    Tries, in order: the processor's chat template with typed content parts (what real
    LLaVA / Qwen-VL processors ship); a chat template (processor's, else tokenizer's) with the
    placeholders inlined in string content; the LLaVA-1.5 format ``USER: <image>\\n... ASSISTANT:``.
    The first rendering holding exactly the right placeholder counts is used.
    frame_labels: the images are a video's frames given as images: each placeholder is written
    as "Frame i: <image>" on its own line (a small LM reads labelled frames far more reliably
    than a bare run of placeholders).
    """
    image_token = getattr(processor, "image_token", None)
    video_token = getattr(processor, "video_token", None)
    if images and image_token is None:
        raise ValueError(f"{type(processor).__name__} has no image_token: cannot place images in the prompt")
    if videos and video_token is None:
        raise ValueError(f"{type(processor).__name__} has no video_token: this model takes no video input")

    def counts_ok(rendered) -> bool:
        return (isinstance(rendered, str)
                and (image_token is None or rendered.count(image_token) == images)
                and (video_token is None or rendered.count(video_token) == videos))

    if frame_labels:
        inline = "".join(f"Frame {i + 1}: {image_token}\n" for i in range(images))
        image_parts = [part for i in range(images) for part in (
            {"type": "text", "text": f"Frame {i + 1}: "}, {"type": "image"}, {"type": "text", "text": "\n"})]
    else:
        inline = (image_token + "\n") * images
        image_parts = [{"type": "image"}] * images
    inline += ((video_token or "") + "\n") * videos + text
    candidates = []
    if getattr(processor, "chat_template", None):
        parts = image_parts + [{"type": "video"}] * videos + [{"type": "text", "text": text}]
        candidates.append(lambda: processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False))
        candidates.append(lambda: processor.apply_chat_template(
            [{"role": "user", "content": inline}], add_generation_prompt=True, tokenize=False))
    tokenizer = getattr(processor, "tokenizer", None)
    if getattr(tokenizer, "chat_template", None):
        candidates.append(lambda: tokenizer.apply_chat_template(
            [{"role": "user", "content": inline}], add_generation_prompt=True, tokenize=False))
    refusals = []
    for render in candidates:
        try:
            rendered = render()
        except _template_errors() as err:
            refusals.append(f"{type(err).__name__}: {err}")
            continue
        if counts_ok(rendered):
            return rendered
        refusals.append("wrong placeholder count")
    if candidates:
        warnings.warn(f"the chat template of {type(processor).__name__} cannot place {images} image and {videos} "
                      f"video placeholder(s) ({'; '.join(refusals)}); using the LLaVA-1.5 prompt format "
                      "'USER: ... ASSISTANT:' instead", stacklevel=2)
    return f"USER: {inline} ASSISTANT:"


def _template_errors() -> tuple[type[Exception], ...]:
    """How a chat template refuses content it cannot render: raise_exception(...) in the template
    (jinja2's TemplateError) or an operation on the wrong type (TypeError, e.g. str + list). Without
    jinja2 transformers' chat templates raise an ImportError naming it, which is not a refusal."""
    try:
        from jinja2 import TemplateError
    except ImportError:
        return (TypeError,)
    return (TemplateError, TypeError)
