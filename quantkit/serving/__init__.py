"""Will the engines load it: vLLM's and SGLang's own quantization-config code, pinned, run in a child
process over a checkpoint's config (engines, harness, checks).
"""
