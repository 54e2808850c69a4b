"""The acceptance-length histogram of eval/mm_speed.py's drafters, drawn with PIL (no matplotlib)."""
from __future__ import annotations


def histogram_png(summary: dict, names: list[str], path: str, task: str = "all") -> None:
    """Grouped bar chart (PIL) of P(accepted drafted tokens per step = a) for each drafter."""
    from PIL import Image, ImageDraw  # noqa: PLC0415

    series = {n: summary[task][n]["accepted_hist"] for n in names if "accepted_hist" in summary[task][n]}
    if not series:
        return
    top = max(max(h, default=0) for h in series.values())
    width, height, left, bottom, pad = 760, 420, 60, 50, 20
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    colours = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]
    plot_w, plot_h = width - left - pad, height - bottom - pad - 30
    fracs = {n: [h.get(a, 0) / max(sum(h.values()), 1) for a in range(top + 1)] for n, h in series.items()}
    ymax = max(max(f) for f in fracs.values()) or 1.0
    draw.line([(left, pad + 30), (left, pad + 30 + plot_h), (left + plot_w, pad + 30 + plot_h)], fill="black")
    for tick in range(5):
        y = pad + 30 + plot_h - plot_h * tick / 4
        draw.line([(left - 4, y), (left, y)], fill="black")
        draw.text((5, y - 6), f"{ymax * tick / 4:.2f}", fill="black")
    group_w = plot_w / (top + 1)
    bar_w = group_w * 0.8 / len(fracs)
    for a in range(top + 1):
        x0 = left + a * group_w + group_w * 0.1
        for i, (name, f) in enumerate(fracs.items()):
            h = plot_h * f[a] / ymax
            x = x0 + i * bar_w
            draw.rectangle([x, pad + 30 + plot_h - h, x + bar_w - 1, pad + 30 + plot_h], fill=colours[i % len(colours)])
        draw.text((left + a * group_w + group_w / 2 - 3, pad + 35 + plot_h), str(a), fill="black")
    draw.text((left + plot_w / 2 - 120, height - 18), "accepted drafted tokens per verification step", fill="black")
    draw.text((left, 4), f"acceptance-length histogram ({task} tasks), fraction of steps", fill="black")
    for i, name in enumerate(fracs):
        x = left + 10 + i * 150
        draw.rectangle([x, 20, x + 10, 30], fill=colours[i % len(colours)])
        draw.text((x + 14, 20), name, fill="black")
    img.save(path)
