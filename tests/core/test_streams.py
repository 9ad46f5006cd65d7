"""The stream keys: the same numbers as every release before them (a seeded run draws
what it drew), and no two uses sharing one."""

from __future__ import annotations

from fedsgld.core import streams


def test_the_keys_are_the_ones_seeded_runs_have_always_drawn_from():
    assert streams.server_noise(5) == (0, 5)
    assert streams.site_round(2, 5) == (3, 5)
    assert streams.site_local_noise(2, 5) == (3, 5, 1)
    assert streams.recal_server_noise(4) == (0, 0x7EC, 4, 0)
    assert streams.recal_site(2, 4) == (3, 0x7EC, 4, 0)
    assert (streams.SWAG_STREAM, streams.EPOCH_TAG) == (0x5A4A, 0xE90C4)
    assert streams.VALIDATION_STREAM == 0x7A1
    assert streams.SITE_RELEASE == (0,)
    assert (streams.PATE_TEACHER, streams.PATE_AGGREGATOR, streams.PATE_STUDENT) == (1, 2, 3)
    assert (streams.AUDIT_DIRECTION, streams.AUDIT_INCLUSION, streams.AUDIT_SAMPLE) == (
        0xA0D1,
        0xA0D2,
        0xA0D3,
    )


def test_no_two_uses_share_a_key():
    keys = [streams.server_noise(t) for t in range(50)]
    for k in range(4):
        keys += [streams.site_round(k, t) for t in range(50)]
        keys += [streams.site_local_noise(k, t) for t in range(50)]
        keys += [streams.recal_site(k, j) for j in range(50)]
    keys += [streams.recal_server_noise(j) for j in range(50)] + [(streams.SWAG_STREAM,)]
    assert len(set(keys)) == len(keys)
