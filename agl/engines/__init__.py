"""Inference engines: the built-in engine (``agl.engines.builtin``) and a vLLM launcher (``agl.engines.vllm``).

Nothing heavy is imported here; import the submodule you need.
"""
