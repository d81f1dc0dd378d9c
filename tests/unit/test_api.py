import re
from collections.abc import Callable
from datetime import timedelta

import pytest

import rdzv
from rdzv import (
    HashStore,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousSettings,
    RendezvousStoreInfo,
    RendezvousTimeout,
)
from rdzv.api import given_node_rank


def test_timeout_defaults() -> None:
    t = RendezvousTimeout()
    assert t.join == timedelta(seconds=600)
    assert t.last_call == timedelta(seconds=30)
    assert t.close == timedelta(seconds=30)
    assert t.heartbeat == timedelta(seconds=5)


def test_timeout_accepts_timedelta_and_seconds() -> None:
    t = RendezvousTimeout(join=timedelta(seconds=7), last_call=1.5, close=2, heartbeat=None)
    assert t.join == timedelta(seconds=7)
    assert t.last_call == timedelta(seconds=1.5)
    assert t.close == timedelta(seconds=2)
    assert t.heartbeat == timedelta(seconds=5)
    assert t == RendezvousTimeout(7, 1.5, 2)
    assert hash(t) == hash(RendezvousTimeout(7, 1.5, 2))


def test_timeout_properties_are_read_only() -> None:
    t = RendezvousTimeout()
    with pytest.raises(AttributeError):
        t.join = timedelta(seconds=1)  # type: ignore[misc]


@pytest.mark.parametrize("field", ["join", "last_call", "close", "heartbeat"])
@pytest.mark.parametrize("value", [0, -1, timedelta(0), timedelta(seconds=-3)])
def test_timeout_rejects_non_positive_and_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^The {field} timeout \(.*\) must be positive\."):
        RendezvousTimeout(**{field: value})  # type: ignore[arg-type]


def test_timeout_rejects_wrong_type() -> None:
    with pytest.raises(TypeError, match="join"):
        RendezvousTimeout(join="10")  # type: ignore[arg-type]


def test_settings_defaults_and_frozen() -> None:
    s = RendezvousSettings("job", 2, 4)
    assert s.timeout == RendezvousTimeout()
    assert s.keep_alive_interval == timedelta(seconds=5)
    assert s.keep_alive_max_attempt == 3
    with pytest.raises(AttributeError):
        s.min_nodes = 3  # type: ignore[misc]


def test_settings_accepts_individual_timeouts() -> None:
    s = RendezvousSettings("job", 1, 1, join=10, last_call=1, close=2, heartbeat=3)
    assert s.timeout == RendezvousTimeout(10, 1, 2, 3)
    s2 = RendezvousSettings("job", 1, 2, keep_alive_interval=1.5)  # type: ignore[arg-type]
    assert s2.keep_alive_interval == timedelta(seconds=1.5)
    assert s2.replace(max_nodes=5).max_nodes == 5


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"run_id": "", "min_nodes": 1, "max_nodes": 1}, "The run id must be a non-empty"),
        (
            {"run_id": "j", "min_nodes": 0, "max_nodes": 1},
            "The minimum number of nodes (0) must be greater than zero.",
        ),
        ({"run_id": "j", "min_nodes": 3, "max_nodes": 2}, "The maximum number of nodes (2)"),
        (
            {"run_id": "j", "min_nodes": 1, "max_nodes": 1, "keep_alive_max_attempt": 0},
            "keep_alive_max_attempt",
        ),
        (
            {"run_id": "j", "min_nodes": 1, "max_nodes": 1, "keep_alive_interval": 0},
            "keep_alive_interval",
        ),
        (
            {
                "run_id": "j",
                "min_nodes": 1,
                "max_nodes": 1,
                "timeout": RendezvousTimeout(),
                "join": 3,
            },
            "not both",
        ),
    ],
)
def test_settings_validation(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        RendezvousSettings(**kwargs)  # type: ignore[arg-type]


def test_parameters_torch_style() -> None:
    p = RendezvousParameters("c10d", "h:1", "job", 2, 4, local_addr="10.0.0.1", join_timeout="60")
    assert (p.backend, p.endpoint, p.run_id, p.min_nodes, p.max_nodes) == (
        "c10d",
        "h:1",
        "job",
        2,
        4,
    )
    assert p.local_addr == "10.0.0.1"
    assert p.node_rank == 0
    assert p.local_world_size == 1
    assert p.get("join_timeout") == "60"
    assert p.get("missing", "dflt") == "dflt"


def test_parameters_tensorplay_style() -> None:
    p = RendezvousParameters(
        "etcd",
        "h",
        "job",
        node_rank=3,
        local_world_size=8,
        config={"min_nodes": "2", "max_nodes": 5, "x": 1},
    )
    assert (p.min_nodes, p.max_nodes, p.node_rank, p.local_world_size) == (2, 5, 3, 8)
    assert p.config == {"x": 1}


def test_parameters_take_torchs_positional_order() -> None:
    p = RendezvousParameters("c10d", "h:1", "job", 2, 4, "10.0.0.1")
    assert (p.min_nodes, p.max_nodes, p.local_addr) == (2, 4, "10.0.0.1")
    with pytest.raises(TypeError, match=r"at most 6 positional arguments .* but 7 were given"):
        RendezvousParameters("c10d", "h:1", "job", 2, 4, "10.0.0.1", 0)
    with pytest.raises(TypeError, match="multiple values for argument 'max_nodes'"):
        RendezvousParameters("c10d", "h:1", "job", 2, 4, max_nodes=4)


def test_node_rank_is_0_by_default_and_a_given_rank_is_told_apart() -> None:
    default = RendezvousParameters("c10d", "h:1", "r")
    assert default.node_rank == 0
    assert type(default.node_rank) is int
    assert given_node_rank(default) is None
    assert given_node_rank(RendezvousParameters("c10d", "h:1", "r", node_rank=0)) == 0
    assert given_node_rank(RendezvousParameters("c10d", "h:1", "r", node_rank=2)) == 2


def test_parameters_min_only_and_none() -> None:
    assert RendezvousParameters("b", "e", "r", 3).max_nodes == 3
    p = RendezvousParameters("b", "e", "r")
    assert (p.min_nodes, p.max_nodes) == (1, 1)


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        (("", "e", "r", 1, 1), {}, "backend"),
        (("  ", "e", "r", 1, 1), {}, "backend"),
        (("b", "e", "r", 0, 1), {}, "The minimum number of rendezvous nodes (0) must be"),
        (
            ("b", "e", "r", 4, 2),
            {},
            "The maximum number of rendezvous nodes (2) must be greater than or equal",
        ),
        (("b", "e", "r"), {"config": {"min_nodes": "x"}}, "min_nodes must be an integer, got 'x'"),
        (("b", "e", "r", 1, 1), {"node_rank": -1}, "node_rank"),
        (("b", "e", "r", 1, 1), {"node_rank": None}, "node_rank"),
        (("b", "e", "r", 1, 1), {"local_world_size": 0}, "local_world_size"),
    ],
)
def test_parameters_validation(
    args: tuple[object, ...], kwargs: dict[str, object], needle: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        RendezvousParameters(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("0", False),
        ("TRUE", True),
        ("False", False),
        ("t", True),
        ("F", False),
        ("yes", True),
        ("No", False),
        ("Y", True),
        ("n", False),
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        (" yes ", True),
    ],
)
def test_get_as_bool(value: object, expected: bool) -> None:
    assert RendezvousParameters("b", "e", "r", 1, 1, flag=value).get_as_bool("flag") is expected


@pytest.mark.parametrize("value", ["2", "maybe", "", 2, 1.5])
def test_get_as_bool_rejects_and_names_key(value: object) -> None:
    p = RendezvousParameters("b", "e", "r", 1, 1, flag=value)
    with pytest.raises(ValueError, match="'flag'"):
        p.get_as_bool("flag")


def test_get_as_bool_and_int_default() -> None:
    p = RendezvousParameters("b", "e", "r", 1, 1)
    assert p.get_as_bool("x") is None
    assert p.get_as_bool("x", True) is True
    assert p.get_as_int("x") is None
    assert p.get_as_int("x", 7) == 7


def test_get_as_int() -> None:
    p = RendezvousParameters("b", "e", "r", 1, 1, a="42", b=-3, c="x", d=True, e=None)
    assert p.get_as_int("a") == 42
    assert p.get_as_int("b") == -3
    assert p.get_as_int("e", 5) == 5
    for key in ("c", "d"):
        with pytest.raises(ValueError, match=f"'{key}'"):
            p.get_as_int(key)


def test_parameters_timeout_property() -> None:
    p = RendezvousParameters(
        "b",
        "e",
        "r",
        1,
        1,
        join_timeout="12",
        last_call_timeout=1.5,
        close_timeout=3,
        heartbeat_timeout="4",
    )
    assert p.timeout == RendezvousTimeout(12, 1.5, 3, 4)
    assert RendezvousParameters("b", "e", "r", 1, 1).timeout == RendezvousTimeout()
    assert RendezvousParameters("b", "e", "r", 1, 1, heartbeat="2").timeout.heartbeat == timedelta(
        seconds=2
    )
    with pytest.raises(ValueError, match="'join_timeout'"):
        _ = RendezvousParameters("b", "e", "r", 1, 1, join_timeout="soon").timeout
    with pytest.raises(ValueError, match=r"The close timeout \(-1 day, 23:59:59\) must be"):
        _ = RendezvousParameters("b", "e", "r", 1, 1, close_timeout="-1").timeout


def test_store_info_build_rank0_publishes_and_others_read() -> None:
    store = HashStore(timeout=5)
    info0 = RendezvousStoreInfo.build(0, store, local_addr="10.1.2.3", server_port=4567)
    assert info0 == RendezvousStoreInfo("10.1.2.3", 4567)
    assert info0.addr == "10.1.2.3"
    info1 = RendezvousStoreInfo.build(1, store)
    assert info1 == info0


def test_store_info_build_rank0_picks_free_port_and_address() -> None:
    store = HashStore(timeout=5)
    info = RendezvousStoreInfo.build(0, store)
    assert 1 <= info.master_port <= 65535
    assert info.master_addr
    assert store.get("MASTER_ADDR") == info.master_addr.encode()
    assert store.get("MASTER_PORT") == str(info.master_port).encode()


def test_store_info_keys_are_torchs() -> None:
    assert RendezvousStoreInfo.MASTER_ADDR_KEY == "MASTER_ADDR"
    assert RendezvousStoreInfo.MASTER_PORT_KEY == "MASTER_PORT"


def test_store_info_build_times_out_without_rank0() -> None:
    store = HashStore(timeout=0.05)
    with pytest.raises(rdzv.RendezvousTimeoutError, match="rank 2 did not see rank 0"):
        RendezvousStoreInfo.build(2, store)


def test_store_info_build_bad_port_is_state_error() -> None:
    store = HashStore(timeout=1)
    store.multi_set(["MASTER_ADDR", "MASTER_PORT"], ["h", "notaport"])
    with pytest.raises(rdzv.RendezvousStateError, match="notaport"):
        RendezvousStoreInfo.build(1, store)


def test_rendezvous_info_properties() -> None:
    store = HashStore()
    bootstrap = RendezvousStoreInfo("h", 1)
    info = RendezvousInfo(store, 1, 3, bootstrap, participants=["a", "b", "c"], wait_list=["d"])
    assert info.store is store
    assert (info.rank, info.world_size) == (1, 3)
    assert info.bootstrap_store_info is bootstrap
    assert info.participants == ("a", "b", "c")
    assert info.wait_list == ("d",)
    with pytest.raises(AttributeError):
        info.rank = 2  # type: ignore[misc]
    bare = RendezvousInfo(store, 0, 1)
    assert bare.bootstrap_store_info is None
    assert bare.participants == ()
    assert bare.wait_list == ()
    assert "rank=0" in repr(bare)


def test_rendezvous_info_builds_lazy_lists_once_on_first_read() -> None:
    calls: list[str] = []

    def build(name: str, nodes: list[str]) -> Callable[[], list[str]]:
        def make() -> list[str]:
            calls.append(name)
            return nodes

        return make

    info = RendezvousInfo(
        HashStore(), 0, 2, participants=build("p", ["a", "b"]), wait_list=build("w", ["c"])
    )
    assert calls == []
    assert info.participants == ("a", "b")
    assert info.participants == ("a", "b")
    assert calls == ["p"]
    assert info.wait_list == ("c",)
    assert info.wait_list == ("c",)
    assert calls == ["p", "w"]
    assert "participants=['a', 'b']" in repr(info)


class _Handler(rdzv.RendezvousHandler):
    def get_backend(self) -> str:
        return "fake"

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(HashStore(), 0, 1)

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "r"

    def shutdown(self) -> bool:
        return True


def test_handler_defaults() -> None:
    h = _Handler()
    assert h.use_agent_store is False
    assert h.pre_shutdown() is None  # type: ignore[func-returns-value]  # the runtime value


def test_handler_is_abstract() -> None:
    with pytest.raises(TypeError):
        rdzv.RendezvousHandler()  # type: ignore[abstract]
