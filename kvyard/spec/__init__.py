"""Speculative decoding: a drafter proposes tokens, the target verifies them all in one forward pass.

`proposer.py` is the drafter interface (n-gram lookup in `ngram.py`, a smaller model in
`draft_model.py`), `adaptive.py` decides how many tokens each request drafts, `rejection.py` and
`verify.py` turn a request's verified logits rows into emitted tokens without changing the output
distribution, and `decoding.py` ties them to the engine's step.
"""
