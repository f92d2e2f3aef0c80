"""`netkit.ports.bindable`: a port something is bound to is not, one nothing holds is."""

from __future__ import annotations

import socket

from netkit.ports import bindable


def test_a_bound_port_is_not_bindable_and_a_released_one_is() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        assert not bindable(port)  # bound, not even listening
        holder.listen()
        assert not bindable(port)
    assert bindable(port)  # the control: let go, the same port probes free
