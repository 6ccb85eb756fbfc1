"""StreamingLLM while decoding: attention sinks plus the most recent entries (Xiao et al., 2023).

https://arxiv.org/abs/2309.17453
"""

from vllm_kvevict.policies.decode.decode_scored import DecodeForm
from vllm_kvevict.policies.streamingllm import StreamingLLM

#: The prefill scorer wrapped (``ScoredDecode``): it reads no queries and keeps no state, an entry's
#: position being its score; keeps the first ``sinks`` positions and the newest ``cap - sinks``.
DecodeStreamingLLM = DecodeForm(StreamingLLM)
