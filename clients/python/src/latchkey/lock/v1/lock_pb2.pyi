from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WaitMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WAIT_NONE: _ClassVar[WaitMode]
    WAIT_UNTIL_DEADLINE: _ClassVar[WaitMode]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_EXCLUSIVE: _ClassVar[Mode]
    MODE_SHARED: _ClassVar[Mode]

class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASON_UNSPECIFIED: _ClassVar[Reason]
    REASON_HELD: _ClassVar[Reason]
    REASON_LEAK: _ClassVar[Reason]
    REASON_SEALED: _ClassVar[Reason]
    REASON_NOT_AUTHORISED: _ClassVar[Reason]
    REASON_BAD_KEY: _ClassVar[Reason]
    REASON_UNKNOWN_CLASS: _ClassVar[Reason]
    REASON_SESSION_EXPIRED: _ClassVar[Reason]
    REASON_SESSION_CLASS_MISMATCH: _ClassVar[Reason]
    REASON_TOKEN_MISMATCH: _ClassVar[Reason]
    REASON_NOT_HELD: _ClassVar[Reason]
    REASON_UNAUTHENTICATED: _ClassVar[Reason]
    REASON_STORE_UNAVAILABLE: _ClassVar[Reason]
    REASON_QUEUE_FULL: _ClassVar[Reason]
    REASON_BAD_REQUEST: _ClassVar[Reason]
    REASON_HOOK_DENIED: _ClassVar[Reason]
    REASON_WAIT_TIMEOUT: _ClassVar[Reason]
    REASON_IDENTITY_LIMIT: _ClassVar[Reason]
    REASON_POLICY_NOT_READY: _ClassVar[Reason]
    REASON_POLICY_STALE: _ClassVar[Reason]
    REASON_EDGE_BUSY: _ClassVar[Reason]
    REASON_RESERVED_HEADER: _ClassVar[Reason]
    REASON_TOO_MANY_STREAMS: _ClassVar[Reason]
    REASON_WRONG_TIER: _ClassVar[Reason]
    REASON_TIER_MOVING: _ClassVar[Reason]
    REASON_RANGE_MOVING: _ClassVar[Reason]
    REASON_SHARD_MAP_CHANGED: _ClassVar[Reason]
    REASON_OVERLOADED: _ClassVar[Reason]
    REASON_NOT_LEADER: _ClassVar[Reason]
    REASON_WRONG_KIND: _ClassVar[Reason]
    REASON_NO_CANDIDATE: _ClassVar[Reason]
    REASON_QUOTA_EXCEEDED: _ClassVar[Reason]
    REASON_KIND_IN_USE: _ClassVar[Reason]
    REASON_BAD_SLOT: _ClassVar[Reason]
    REASON_UPGRADE_REFUSED: _ClassVar[Reason]
WAIT_NONE: WaitMode
WAIT_UNTIL_DEADLINE: WaitMode
MODE_EXCLUSIVE: Mode
MODE_SHARED: Mode
REASON_UNSPECIFIED: Reason
REASON_HELD: Reason
REASON_LEAK: Reason
REASON_SEALED: Reason
REASON_NOT_AUTHORISED: Reason
REASON_BAD_KEY: Reason
REASON_UNKNOWN_CLASS: Reason
REASON_SESSION_EXPIRED: Reason
REASON_SESSION_CLASS_MISMATCH: Reason
REASON_TOKEN_MISMATCH: Reason
REASON_NOT_HELD: Reason
REASON_UNAUTHENTICATED: Reason
REASON_STORE_UNAVAILABLE: Reason
REASON_QUEUE_FULL: Reason
REASON_BAD_REQUEST: Reason
REASON_HOOK_DENIED: Reason
REASON_WAIT_TIMEOUT: Reason
REASON_IDENTITY_LIMIT: Reason
REASON_POLICY_NOT_READY: Reason
REASON_POLICY_STALE: Reason
REASON_EDGE_BUSY: Reason
REASON_RESERVED_HEADER: Reason
REASON_TOO_MANY_STREAMS: Reason
REASON_WRONG_TIER: Reason
REASON_TIER_MOVING: Reason
REASON_RANGE_MOVING: Reason
REASON_SHARD_MAP_CHANGED: Reason
REASON_OVERLOADED: Reason
REASON_NOT_LEADER: Reason
REASON_WRONG_KIND: Reason
REASON_NO_CANDIDATE: Reason
REASON_QUOTA_EXCEEDED: Reason
REASON_KIND_IN_USE: Reason
REASON_BAD_SLOT: Reason
REASON_UPGRADE_REFUSED: Reason

class OpenSessionRequest(_message.Message):
    __slots__ = ("reuse_session_ids",)
    CLASS_FIELD_NUMBER: _ClassVar[int]
    REUSE_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    reuse_session_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reuse_session_ids: _Optional[_Iterable[int]] = ..., **kwargs) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "ttl_seconds", "keepalive_interval_ms", "reused")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    ttl_seconds: int
    keepalive_interval_ms: int
    reused: bool
    def __init__(self, session_id: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., keepalive_interval_ms: _Optional[int] = ..., reused: _Optional[bool] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id", "session_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    session_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[int] = ..., session_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("session_id", "remaining_ttl_seconds", "ended_holds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENDED_HOLDS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    remaining_ttl_seconds: int
    ended_holds: _containers.RepeatedCompositeFieldContainer[EndedHold]
    def __init__(self, session_id: _Optional[int] = ..., remaining_ttl_seconds: _Optional[int] = ..., ended_holds: _Optional[_Iterable[_Union[EndedHold, _Mapping]]] = ...) -> None: ...

class EndedHold(_message.Message):
    __slots__ = ("key", "revision", "slot", "mode")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    key: str
    revision: int
    slot: int
    mode: Mode
    def __init__(self, key: _Optional[str] = ..., revision: _Optional[int] = ..., slot: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("key", "session_id", "wait", "metadata", "instance", "mode", "downgrade_from")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    CLASS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DOWNGRADE_FROM_FIELD_NUMBER: _ClassVar[int]
    key: str
    session_id: int
    wait: WaitMode
    metadata: _containers.ScalarMap[str, str]
    instance: str
    mode: Mode
    downgrade_from: int
    def __init__(self, key: _Optional[str] = ..., session_id: _Optional[int] = ..., wait: _Optional[_Union[WaitMode, str]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., instance: _Optional[str] = ..., mode: _Optional[_Union[Mode, str]] = ..., downgrade_from: _Optional[int] = ..., **kwargs) -> None: ...

class Grant(_message.Message):
    __slots__ = ("key", "token", "epoch", "revision", "session_id", "unprotected", "slot", "mode", "permits")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    UNPROTECTED_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PERMITS_FIELD_NUMBER: _ClassVar[int]
    key: str
    token: int
    epoch: int
    revision: int
    session_id: int
    unprotected: bool
    slot: int
    mode: Mode
    permits: int
    def __init__(self, key: _Optional[str] = ..., token: _Optional[int] = ..., epoch: _Optional[int] = ..., revision: _Optional[int] = ..., session_id: _Optional[int] = ..., unprotected: _Optional[bool] = ..., slot: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., permits: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("grant",)
    GRANT_FIELD_NUMBER: _ClassVar[int]
    grant: Grant
    def __init__(self, grant: _Optional[_Union[Grant, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("key", "session_id", "token", "slot", "mode")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    key: str
    session_id: int
    token: int
    slot: int
    mode: Mode
    def __init__(self, key: _Optional[str] = ..., session_id: _Optional[int] = ..., token: _Optional[int] = ..., slot: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("identity", "session_id", "token", "acquired_at_unix_ms", "annotations", "slot", "mode")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLASS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    identity: str
    session_id: int
    token: int
    acquired_at_unix_ms: int
    annotations: _containers.ScalarMap[str, str]
    slot: int
    mode: Mode
    def __init__(self, identity: _Optional[str] = ..., session_id: _Optional[int] = ..., token: _Optional[int] = ..., acquired_at_unix_ms: _Optional[int] = ..., annotations: _Optional[_Mapping[str, str]] = ..., slot: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., **kwargs) -> None: ...

class InspectResponse(_message.Message):
    __slots__ = ("key", "holder", "waiters", "durable_waiters", "slot_holders", "shared_holders", "shared_holder_count")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    WAITERS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_WAITERS_FIELD_NUMBER: _ClassVar[int]
    SLOT_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    SHARED_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    SHARED_HOLDER_COUNT_FIELD_NUMBER: _ClassVar[int]
    key: str
    holder: Holder
    waiters: int
    durable_waiters: int
    slot_holders: _containers.RepeatedCompositeFieldContainer[Holder]
    shared_holders: _containers.RepeatedCompositeFieldContainer[Holder]
    shared_holder_count: int
    def __init__(self, key: _Optional[str] = ..., holder: _Optional[_Union[Holder, _Mapping]] = ..., waiters: _Optional[int] = ..., durable_waiters: _Optional[int] = ..., slot_holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., shared_holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., shared_holder_count: _Optional[int] = ...) -> None: ...
