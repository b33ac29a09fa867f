"""`quantkit probe URL --pair DIR`: does a live OpenAI-compatible endpoint serve the checkpoints quantkit made?

A provider's "GLM 5.2" is not necessarily the checkpoint on the Hub, and a user cannot inspect it.
The probe sends a fixed, recorded prompt set (prompts.json, greedy), computes the same continuations
with quantkit's own streaming forward for every checkpoint of the pair (source, prefill, decode,
the disaggregated hand-over, each with and without an FP8 KV cache) in each numerics a server may
compute it in, and names the one the endpoint behaves like when the evidence separates it, else says
it cannot tell. Parts:

    prompts    the recorded prompt set and its token ids under the pair's tokenizer
    client     the HTTP side: API key, timeouts, retries, bounded concurrency, one-line errors
    reference  the candidates' greedy continuations and log-probabilities (quantkit.validation.forward)
    compare    agreement up to the first divergence, top-k KL, the sign-test verdict (or cannot tell), the power
    tools      --tool-task: the tool prompts with tools=, an endpoint without tool support, the printed lines
    pipeline   the command: check the endpoint, then compute, compare, report, write the cards
"""
