"""The stores megappo hosts listen on the address they are given (megappo.parallel.listen), not `*:PORT`."""

import datetime

import psutil
import torch.distributed as dist

from megappo.parallel.listen import is_loopback, store_server
from megappo.rollout.update_group import free_port, open_update_group


def listening_ports() -> dict[int, str]:
    return {c.laddr.port: c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN}


def test_store_server_listens_on_its_address_and_serves_clients():
    store = store_server("127.0.0.1", 0, 2, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    assert listening_ports()[store.port] == "127.0.0.1"
    client = dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("10.0.0.1")


def test_the_weight_update_groups_store_listens_on_the_update_address():
    port = free_port()
    group = open_update_group(master_address="127.0.0.1", master_port=port, world_size=1, rank=0,
                              group_name="test_update_group", backend="gloo", timeout_s=20)
    assert listening_ports()[port] == "127.0.0.1"
    dist.destroy_process_group(group)
