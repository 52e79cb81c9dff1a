"""Wire models: everything that crosses a process boundary or lands in a database row."""

from agl.schemas._base import WireModel, new_id, now_s
from agl.schemas.attempt import Attempt, AttemptedRollout, AttemptStatus
from agl.schemas.llm_call import LLMCall
from agl.schemas.resources import LLM, JsonResource, ModelWeights, PromptTemplate, Resource, ResourcesVersion
from agl.schemas.rollout import RetryConfig, Rollout, RolloutCreate, RolloutStatus
from agl.schemas.span import Span, SpanEvent, SpanKind, SpanLink, SpanStatus, StatusCode
from agl.schemas.worker import Worker, WorkerStatus

__all__ = [
    "LLM",
    "Attempt",
    "AttemptStatus",
    "AttemptedRollout",
    "JsonResource",
    "LLMCall",
    "ModelWeights",
    "PromptTemplate",
    "Resource",
    "ResourcesVersion",
    "RetryConfig",
    "Rollout",
    "RolloutCreate",
    "RolloutStatus",
    "Span",
    "SpanEvent",
    "SpanKind",
    "SpanLink",
    "SpanStatus",
    "StatusCode",
    "WireModel",
    "Worker",
    "WorkerStatus",
    "new_id",
    "now_s",
]
