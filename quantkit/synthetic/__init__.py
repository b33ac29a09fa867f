"""Models quantkit builds itself: the embedded tiny models (trained, real on-disk formats) and the
real-shape random-weight layers used to prove memory and time at real width.
"""

# The embedded tiny models (quantkit.synthetic.tiny builds them), here so the CLI can name them without torch.
TINY_NAMES = ("kimi-k2.6", "glm-5.2", "qwen3-moe")
