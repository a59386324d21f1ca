"""fedkit uses Flower through its public API everywhere but ``fedkit.flower.internals``,
and what that module takes from Flower's internals is still there, with the signatures it
relies on, in the installed Flower (which the ``flower`` extra's pin admits)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

flwr = pytest.importorskip("flwr", reason="the flower extra is not installed")

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ("flwr", "flwr.app", "flwr.clientapp", "flwr.serverapp", "flwr.simulation")
"""The modules Flower documents as its API (``flwr.app``'s own submodules are not)."""
SECAGG = ("flwr.client.mod", "flwr.common", "flwr.server", "flwr.server.workflow")
"""The documented API packages of Flower's SecAgg+ (its client mod, its workflow and the
legacy ``LegacyContext``/``FitIns`` types they speak), used by ``fedkit/flower/secagg.py``
alone."""


def flower_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "flwr"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flwr":
            found.add(node.module)
    return found


def test_only_the_internals_module_imports_flowers_internals():
    internal = {}
    for path in sorted((ROOT / "fedkit").rglob("*.py")):
        allowed = PUBLIC + SECAGG if path.name == "secagg.py" else PUBLIC
        beyond = {m for m in flower_imports(path) if m not in allowed}
        if beyond:
            internal[str(path.relative_to(ROOT))] = beyond
    assert set(internal) == {"fedkit/flower/internals.py"}, internal


def test_the_installed_flower_is_the_one_the_extra_pins():
    from packaging.specifiers import SpecifierSet

    text = (ROOT / "pyproject.toml").read_text()
    pins = set(re.findall(r'"flwr([<>=!~][^"]*)"', text))
    assert pins, "pyproject.toml names no flwr version range"
    for pin in pins:
        assert flwr.__version__ in SpecifierSet(pin), (flwr.__version__, pin)


def test_what_the_internals_use_is_there_with_the_signatures_they_rely_on():
    from flwr.app import Message, Metadata
    from flwr.common.constant import ErrorCode
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supernode.fleet_http_connection import http_request_response

    def params(fn) -> list[str]:
        return list(inspect.signature(fn).parameters)

    assert params(http_request_response)[:4] == [
        "server_address", "insecure", "root_certificates", "authentication_keys",
    ]  # fmt: skip
    assert "return_type" in params(inflatable_utils.pull_and_inflate_object_from_tree)
    assert "object_ids_to_push" in params(inflatable_utils.push_objects)
    assert {"initial_backoff", "backoff_cap", "max_tries_per_object"} <= set(
        params(inflatable_utils.pull_objects)
    )
    assert hasattr(ErrorCode, "CLIENT_APP_RAISED_EXCEPTION")
    meta = Metadata(
        run_id=1, message_id="", src_node_id=1, dst_node_id=2, reply_to_message_id="",
        group_id="", created_at=0.0, ttl=1.0, message_type="query",
    )  # fmt: skip
    assert "_message_id" in meta.__dict__  # the id ``pull``/``push`` restore and set
    assert isinstance(Message, type)


def test_quick_pulls_shortens_every_pull_in_the_process():
    from flwr.supercore.inflatable import inflatable_utils

    from fedkit.flower import internals

    internals.quick_pulls()
    patched = inflatable_utils.pull_objects
    assert patched.fedkit_quick
    for name in internals.PULL_USERS:
        module = __import__(name, fromlist=["pull_objects"])
        assert module.pull_objects is patched, name
    internals.quick_pulls()  # a second call wraps nothing twice
    assert inflatable_utils.pull_objects is patched


def test_what_keeps_a_node_alive_across_restarts_is_there_as_the_internals_expect():
    """``connect`` replaces what Flower's connection uses to end the process (its module's
    ``os``, ``flwr_exit``, ``HeartbeatSender`` and retry invoker, and ``http_retry``'s
    ``os``); each must still be looked up there, used the way the replacements assume."""
    from flwr.common import constant
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.supercore.error import ApiErrorCode, FlowerError
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.retry import http_retry
    from flwr.supernode import fleet_http_connection as fleet

    from fedkit.flower import internals

    connection = inspect.getsource(fleet.http_request_response)
    assert "max_wait_time" in inspect.signature(fleet.http_request_response).parameters
    for used in (
        "os.kill(os.getpid(), signal.SIGINT)",  # on a 401 heartbeat
        "HeartbeatSender(send_node_heartbeat)",
        "retry_invoker = make_simple_http_retry_invoker()",
        "flwr_exit(",  # a join that failed
    ):
        assert used in connection, used
    for name in ("os", "flwr_exit", "HeartbeatSender", "make_simple_http_retry_invoker"):
        assert hasattr(fleet, name), name
    assert "os.kill(os.getpid(), signal.SIGINT)" in inspect.getsource(http_retry)
    assert params(HeartbeatSender)[:1] == ["heartbeat_fn"]
    invoker = http_retry.make_simple_http_retry_invoker()
    assert invoker.on_backoff is not None and invoker.max_time is None
    assert ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED == 2004
    assert ApiErrorCode.FLEET_SUPERNODE_REGISTRATION_DISABLED == 2001
    assert FlowerError.from_json('{"code": 2004, "detail": "x"}').code == 2004
    # a node is held online for HEARTBEAT_PATIENCE intervals; an online node is not activated
    assert internals.ONLINE_FOR == constant.HEARTBEAT_PATIENCE * constant.HEARTBEAT_DEFAULT_INTERVAL
    activate = inspect.getsource(InMemoryLinkState.activate_node)
    assert "NodeStatus.REGISTERED, NodeStatus.OFFLINE" in activate
    assert "HEARTBEAT_PATIENCE * heartbeat_interval" in activate


def params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]
