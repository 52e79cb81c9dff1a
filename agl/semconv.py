"""Span names and attribute keys agl writes and reads: one vocabulary for gateway, tracer and adapters.

The gateway records each model call as one ``agl.llm.call`` span with the ``LLM_*`` attributes.
The tracer copies what auto-instrumentation (OpenInference and others) records into the same keys,
so adapters read one view (:class:`agl.schemas.LLMCall`) whatever produced the span.
"""

from __future__ import annotations

# ----- span names ----------------------------------------------------------------------------
SPAN_LLM_CALL = "agl.llm.call"
SPAN_EMBEDDINGS = "agl.llm.embeddings"  # a gateway embeddings call: recorded, never a training sample
SPAN_REWARD = "agl.reward"
SPAN_MESSAGE = "agl.message"
SPAN_OBJECT = "agl.object"
SPAN_EXCEPTION = "agl.exception"
SPAN_ANNOTATION = "agl.annotation"
SPAN_OPERATION = "agl.operation"
SPAN_ROLLOUT = "agl.rollout"
SPAN_JUDGE = "agl.judge"  # a reward judge's call for a group (agl.rewards.Judge): recorded, never trained on

# ----- the LLM call view (values are JSON: objects and lists allowed) -------------------------
# "chat.completions" | "completions" | "responses" | "anthropic.messages" (sent upstream as chat) | "embeddings"
LLM_API = "agl.llm.api"
LLM_REQUEST = "agl.llm.request"  # the request body, secrets removed
LLM_RESPONSE = "agl.llm.response"  # the response body (for streams: the assembled response)
LLM_REQUEST_MESSAGES = "agl.llm.request.messages"  # list of OpenAI chat messages
LLM_PROMPT = "agl.llm.prompt"  # text prompt of a completions call
LLM_RESPONSE_MESSAGE = "agl.llm.response.message"  # {"role", "content", "tool_calls"}
LLM_TOOL_CALLS = "agl.llm.response.tool_calls"
# a reasoning model's thinking (the ``<think>`` block's text), as the engine split it off into
# ``message.reasoning_content`` (vLLM: ``reasoning_content`` or ``reasoning``); absent when there was none
LLM_REASONING = "agl.llm.response.reasoning"
LLM_MODEL = "agl.llm.model"
LLM_BACKEND = "agl.llm.backend"
LLM_MODEL_VERSION = "agl.llm.model_version"
LLM_RESPONSE_ID = "agl.llm.response_id"
LLM_FINISH_REASON = "agl.llm.finish_reason"
LLM_USAGE = "agl.llm.usage"  # {"prompt_tokens", "completion_tokens", "total_tokens"}
LLM_LATENCY_MS = "agl.llm.latency_ms"
LLM_STATUS_CODE = "agl.llm.status_code"
LLM_ERROR = "agl.llm.error"
LLM_STREAM = "agl.llm.stream"
LLM_PROMPT_TOKEN_IDS = "agl.llm.prompt_token_ids"  # list[int], from the engine
LLM_COMPLETION_TOKEN_IDS = "agl.llm.completion_token_ids"  # list[int], from the engine
LLM_LOGPROBS = "agl.llm.logprobs"  # list[float], one per completion token, from the engine
LLM_HAS_TOKEN_IDS = "agl.llm.has_token_ids"  # False when the backend returned none (fail closed)
LLM_SOURCE = "agl.llm.source"  # "gateway" | "openinference" | ...

# ----- rollout metadata ------------------------------------------------------------------------
ROLLOUT_MODE_ONLINE = "online"  # production traffic the gateway recorded, one rollout a conversation
TRAINING_RECORD = "agl.training"  # what a GRPO step trained on this rollout (agl/algorithm/grpo/record.py)

# ----- attribution and tags --------------------------------------------------------------------
ROLLOUT_ID = "agl.rollout_id"
ATTEMPT_ID = "agl.attempt_id"
RESOURCES_ID = "agl.resources_id"
AGENT_NAME = "agl.agent.name"
TAGS = "agl.tags"

# ----- rewards and other emitted values ------------------------------------------------------
REWARD_VALUE = "agl.reward.value"  # the primary reward, float
REWARD_VALUES = "agl.reward.values"  # {name: float}, primary first
REWARD_PRIMARY_KEY = "agl.reward.primary_key"
REWARD_RESPONSE_ID = "agl.reward.response_id"  # the LLM response this reward judges (per-call reward)
MESSAGE_TEXT = "agl.message.text"
OBJECT_VALUE = "agl.object.value"
EXCEPTION_TYPE = "agl.exception.type"
EXCEPTION_MESSAGE = "agl.exception.message"
EXCEPTION_STACKTRACE = "agl.exception.stacktrace"
ANNOTATION = "agl.annotation"
OPERATION_NAME = "agl.operation.name"
OPERATION_INPUT = "agl.operation.input"
OPERATION_OUTPUT = "agl.operation.output"

# ----- a reward judge's verdict (agl.rewards.Judge); its reward spans are tagged "judge" ----------
REWARD_REASON = "agl.reward.reason"  # the judge's one-line reason for the reward
JUDGE_MODEL = "agl.judge.model"
JUDGE_GROUP_ID = "agl.judge.group_id"
JUDGE_ROLLOUT_IDS = "agl.judge.rollout_ids"  # the rollouts shown side by side, in the order shown
JUDGE_INDEX = "agl.judge.index"  # this rollout's trajectory number in the judge's prompt (1-based)
JUDGE_REQUEST_MESSAGES = "agl.judge.request.messages"  # on the span of the first rollout shown
JUDGE_REPLIES = "agl.judge.replies"  # the judge's raw reply of every try, in order
JUDGE_SCORE = "agl.judge.score"
JUDGE_ERROR = "agl.judge.error"  # why the judge gave no usable scores
JUDGE_TAG = "judge"
