"""The example plugin passes kvpolicy's conformance suite (one line per method)."""

from kvpolicy_core.testing import PolicyConformance


class TestStreamingLLM(PolicyConformance):
    method = "streamingllm:budget=16,n_sink=2"


class TestTova(PolicyConformance):
    method = "tova:budget=16,n_sink=2"


class TestTovaProxy(PolicyConformance):
    method = "tova:budget=16,n_sink=2,signal=proxy,recent=1"
