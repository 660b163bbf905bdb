"""What a request may ask of a speculative engine: sampling options whose logits depend on the output so far are
refused, naming the field.

SGLang's penalties and min_new_tokens (engine/penalties.py) read a request's output counts, which inside one verify
forward change from row to row with the drafts before each row; the verify applies none of them, so a request that
sets one is refused rather than sampled from other logits than asked. Temperature, top-k, top-p, min-p and seeds
are per-row and apply to every verify row and draft (Sampler.probs).
"""

from __future__ import annotations

from ..request import InvalidRequestError, SamplingParams

# field -> its neutral value
_OUTPUT_DEPENDENT = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0}


def check_speculative_request(params: SamplingParams) -> None:
    if params.logit_bias:  # verify and drafts read Sampler.probs, which does not add it
        raise InvalidRequestError("sampling_params.logit_bias", "is not supported with speculative decoding (the "
                                  "engine runs speculative_algorithm); leave it out")
    for name, neutral in _OUTPUT_DEPENDENT.items():
        value = getattr(params, name)
        if value != neutral:
            raise InvalidRequestError(f"sampling_params.{name}", f"{value!r} is not supported with speculative "
                                      f"decoding (the engine runs speculative_algorithm); leave it at {neutral!r}")
