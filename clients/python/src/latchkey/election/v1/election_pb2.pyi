from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VacancyReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VACANCY_REASON_UNSPECIFIED: _ClassVar[VacancyReason]
    VACANCY_REASON_RESIGNED: _ClassVar[VacancyReason]
    VACANCY_REASON_SESSION_ENDED: _ClassVar[VacancyReason]
    VACANCY_REASON_FORCED: _ClassVar[VacancyReason]
    VACANCY_REASON_EPOCH_ADVANCED: _ClassVar[VacancyReason]
VACANCY_REASON_UNSPECIFIED: VacancyReason
VACANCY_REASON_RESIGNED: VacancyReason
VACANCY_REASON_SESSION_ENDED: VacancyReason
VACANCY_REASON_FORCED: VacancyReason
VACANCY_REASON_EPOCH_ADVANCED: VacancyReason

class CampaignRequest(_message.Message):
    __slots__ = ("election", "session_id", "value", "priority", "instance")
    ELECTION_FIELD_NUMBER: _ClassVar[int]
    CLASS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    election: str
    session_id: int
    value: str
    priority: int
    instance: str
    def __init__(self, election: _Optional[str] = ..., session_id: _Optional[int] = ..., value: _Optional[str] = ..., priority: _Optional[int] = ..., instance: _Optional[str] = ..., **kwargs) -> None: ...

class Leadership(_message.Message):
    __slots__ = ("election", "term", "token", "session_id", "value")
    ELECTION_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    election: str
    term: int
    token: int
    session_id: int
    value: str
    def __init__(self, election: _Optional[str] = ..., term: _Optional[int] = ..., token: _Optional[int] = ..., session_id: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...

class CampaignResponse(_message.Message):
    __slots__ = ("leadership",)
    LEADERSHIP_FIELD_NUMBER: _ClassVar[int]
    leadership: Leadership
    def __init__(self, leadership: _Optional[_Union[Leadership, _Mapping]] = ...) -> None: ...

class ProclaimRequest(_message.Message):
    __slots__ = ("election", "session_id", "token", "value")
    ELECTION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    election: str
    session_id: int
    token: int
    value: str
    def __init__(self, election: _Optional[str] = ..., session_id: _Optional[int] = ..., token: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...

class ProclaimResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaderRequest(_message.Message):
    __slots__ = ("election",)
    ELECTION_FIELD_NUMBER: _ClassVar[int]
    election: str
    def __init__(self, election: _Optional[str] = ...) -> None: ...

class LeaderInfo(_message.Message):
    __slots__ = ("identity", "value", "term", "since_unix_ms", "priority")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    identity: str
    value: str
    term: int
    since_unix_ms: int
    priority: int
    def __init__(self, identity: _Optional[str] = ..., value: _Optional[str] = ..., term: _Optional[int] = ..., since_unix_ms: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class LeaderResponse(_message.Message):
    __slots__ = ("election", "leader")
    ELECTION_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    election: str
    leader: LeaderInfo
    def __init__(self, election: _Optional[str] = ..., leader: _Optional[_Union[LeaderInfo, _Mapping]] = ...) -> None: ...

class ObserveRequest(_message.Message):
    __slots__ = ("election", "from_term", "transfer_requests")
    ELECTION_FIELD_NUMBER: _ClassVar[int]
    FROM_TERM_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    election: str
    from_term: int
    transfer_requests: bool
    def __init__(self, election: _Optional[str] = ..., from_term: _Optional[int] = ..., transfer_requests: _Optional[bool] = ...) -> None: ...

class TermStarted(_message.Message):
    __slots__ = ("leader",)
    LEADER_FIELD_NUMBER: _ClassVar[int]
    leader: LeaderInfo
    def __init__(self, leader: _Optional[_Union[LeaderInfo, _Mapping]] = ...) -> None: ...

class Proclaimed(_message.Message):
    __slots__ = ("term", "value")
    TERM_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    term: int
    value: str
    def __init__(self, term: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...

class Vacant(_message.Message):
    __slots__ = ("term", "reason")
    TERM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    term: int
    reason: VacancyReason
    def __init__(self, term: _Optional[int] = ..., reason: _Optional[_Union[VacancyReason, str]] = ...) -> None: ...

class Gap(_message.Message):
    __slots__ = ("from_term", "to_term")
    FROM_TERM_FIELD_NUMBER: _ClassVar[int]
    TO_TERM_FIELD_NUMBER: _ClassVar[int]
    from_term: int
    to_term: int
    def __init__(self, from_term: _Optional[int] = ..., to_term: _Optional[int] = ...) -> None: ...

class TransferRequested(_message.Message):
    __slots__ = ("term", "priority")
    TERM_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    term: int
    priority: int
    def __init__(self, term: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class ObserveResponse(_message.Message):
    __slots__ = ("term_started", "proclaimed", "vacant", "gap", "transfer_requested")
    TERM_STARTED_FIELD_NUMBER: _ClassVar[int]
    PROCLAIMED_FIELD_NUMBER: _ClassVar[int]
    VACANT_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    term_started: TermStarted
    proclaimed: Proclaimed
    vacant: Vacant
    gap: Gap
    transfer_requested: TransferRequested
    def __init__(self, term_started: _Optional[_Union[TermStarted, _Mapping]] = ..., proclaimed: _Optional[_Union[Proclaimed, _Mapping]] = ..., vacant: _Optional[_Union[Vacant, _Mapping]] = ..., gap: _Optional[_Union[Gap, _Mapping]] = ..., transfer_requested: _Optional[_Union[TransferRequested, _Mapping]] = ...) -> None: ...

class ResignRequest(_message.Message):
    __slots__ = ("election", "session_id", "token")
    ELECTION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    election: str
    session_id: int
    token: int
    def __init__(self, election: _Optional[str] = ..., session_id: _Optional[int] = ..., token: _Optional[int] = ...) -> None: ...

class ResignResponse(_message.Message):
    __slots__ = ("next",)
    NEXT_FIELD_NUMBER: _ClassVar[int]
    next: LeaderInfo
    def __init__(self, next: _Optional[_Union[LeaderInfo, _Mapping]] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("election", "session_id", "token", "candidate_id", "preferred", "higher_priority")
    ELECTION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_FIELD_NUMBER: _ClassVar[int]
    HIGHER_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    election: str
    session_id: int
    token: int
    candidate_id: int
    preferred: bool
    higher_priority: bool
    def __init__(self, election: _Optional[str] = ..., session_id: _Optional[int] = ..., token: _Optional[int] = ..., candidate_id: _Optional[int] = ..., preferred: _Optional[bool] = ..., higher_priority: _Optional[bool] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("next",)
    NEXT_FIELD_NUMBER: _ClassVar[int]
    next: LeaderInfo
    def __init__(self, next: _Optional[_Union[LeaderInfo, _Mapping]] = ...) -> None: ...

class CandidatesRequest(_message.Message):
    __slots__ = ("election",)
    ELECTION_FIELD_NUMBER: _ClassVar[int]
    election: str
    def __init__(self, election: _Optional[str] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("candidate_id", "identity", "value", "priority", "since_unix_ms")
    CANDIDATE_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    candidate_id: int
    identity: str
    value: str
    priority: int
    since_unix_ms: int
    def __init__(self, candidate_id: _Optional[int] = ..., identity: _Optional[str] = ..., value: _Optional[str] = ..., priority: _Optional[int] = ..., since_unix_ms: _Optional[int] = ...) -> None: ...

class CandidatesResponse(_message.Message):
    __slots__ = ("election", "candidates")
    ELECTION_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    election: str
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, election: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...
