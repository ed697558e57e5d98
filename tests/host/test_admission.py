"""The host's bound on completions in flight: global, and per tenant where several share it."""

from __future__ import annotations

import pytest

from host.errors import ApiError
from host.metrics import RequestRecord
from host.request_scope import Admission, tenant_limit


def test_one_tenant_alone_may_take_the_whole_limit():
    assert tenant_limit(8, 0.5, tenants=0) == 8
    assert tenant_limit(8, 0.5, tenants=1) == 8
    assert tenant_limit(8, 0.5, tenants=2) == 4
    assert tenant_limit(3, 0.1, tenants=5) == 1  # never less than one slot


async def test_a_tenant_past_its_share_is_refused_while_another_is_admitted():
    admission = Admission(4, tenant_limit=2)
    records = [RequestRecord(f"r{i}", "POST", "/v1/completions") for i in range(5)]
    admission.admit(records[0], "a")
    admission.admit(records[1], "a")
    with pytest.raises(ApiError) as info:
        admission.admit(records[2], "a")
    assert info.value.status == 429 and "tenant is at its share of 2" in info.value.message
    admission.admit(records[3], "b")
    admission.admit(records[4], "b")
    with pytest.raises(ApiError) as info:
        admission.admit(RequestRecord("r5", "POST", "/v1/completions"), "c")
    assert "at its limit of 4 requests" in info.value.message
    for closer in records[0].closers:  # a request of "a" ends: its slot is "a"'s again
        await closer()
    assert admission.inflight == 3 and admission.by_tenant == {"a": 1, "b": 2}
    admission.admit(records[2], "a")
    for record in (records[1], records[2], records[3], records[4]):
        for closer in record.closers:
            await closer()
    assert admission.inflight == 0 and admission.by_tenant == {}
