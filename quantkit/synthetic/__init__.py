"""Models quantkit builds itself: the embedded tiny models (trained, real on-disk formats) and the
real-shape random-weight layers used to prove memory and time at real width.
"""
