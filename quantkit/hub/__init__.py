"""The Hugging Face Hub side: a pinned-commit source, listing, verified resumable download and the
local store layout. The only package that talks to the network.
"""
