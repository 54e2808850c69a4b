"""The questions the reference LMM is asked about what it sees (the caption demo's prompts).

The reference LMM's frozen SmolLM2 reads a scene's caption written in soft tokens. Asked to
"Describe the video." about eight such frames it tells a story of its own ("a 2019-themed video
game called 'The Legend of Zelda' ..."); asked which coloured shapes the video shows, in one
sentence, it names them. Images keep the pipeline's "Describe the image.": it names the objects
more often than the one-sentence question does (which draws shapes that are not there), though it
sometimes goes on with a story ("a classic example of a scene from the movie 'The Matrix'").
Measured on 24 + 24 held-out scenes and clips by ``eval/caption_accuracy.py`` (README, "The
reference LMM").
"""

CAPTION_PROMPTS = {
    "image": "Describe the image.",
    "video": "Which coloured shapes does the video show? Answer in one sentence.",
}
