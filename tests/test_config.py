"""Settings every role shares are validated where a mistake would bite later."""

import argparse

import pytest

from pdq.config import DecodeConfig, GatewayConfig, PrefillConfig, SchedulerConfig, add_arguments, from_arguments


def test_worker_timeout_is_one_setting_for_every_role():
    for cls in (GatewayConfig, SchedulerConfig, PrefillConfig, DecodeConfig):
        assert cls(worker_timeout_s=4.0).worker_timeout_s == 4.0
        with pytest.raises(ValueError, match="worker_timeout_s"):
            cls(worker_timeout_s=0)


def test_a_heartbeat_too_slow_for_the_timeout_is_refused():
    with pytest.raises(ValueError, match="heartbeat_s"):
        DecodeConfig(heartbeat_s=6.0, worker_timeout_s=10.0)
    assert PrefillConfig(heartbeat_s=5.0, worker_timeout_s=10.0).heartbeat_s == 5.0


def test_internal_tls_files_go_together():
    with pytest.raises(ValueError, match="go together"):
        SchedulerConfig(internal_ca="ca.pem")


def test_listening_ports_must_be_ports():
    for cls in (GatewayConfig, SchedulerConfig, PrefillConfig, DecodeConfig):
        with pytest.raises(ValueError, match="port must be 0"):
            cls(port=-5)
        with pytest.raises(ValueError, match="port must be 0"):
            cls(port=70000)
    with pytest.raises(ValueError, match="kv_port must be 0"):
        DecodeConfig(kv_port=-1)
    assert DecodeConfig(port=0, kv_port=50072).kv_port == 50072


def test_yield_to_prefill_is_bounded():
    assert DecodeConfig().yield_to_prefill_ms == 0  # off unless the decode worker shares its cores (pdq up)
    for bad in (-1, 10_001):
        with pytest.raises(ValueError, match="yield_to_prefill_ms must be in"):
            DecodeConfig(yield_to_prefill_ms=bad)


def test_a_colocated_worker_takes_its_prefill_settings_and_its_own_registry_entry():
    assert not DecodeConfig().colocate
    for name in ("step_tokens", "prefill_chunk"):
        with pytest.raises(ValueError, match=f"{name} must be > 0"):
            DecodeConfig(**{name: 0})
    cfg = DecodeConfig(colocate=True, worker_id="w1", step_tokens=256, prefill_chunk=64, port=50099)
    pre = cfg.prefill_config()
    assert (pre.max_batched_tokens, pre.prefill_chunk, pre.port) == (256, 64, 50099)
    assert pre.name("prefill") == "w1-prefill" != cfg.name("decode")  # two registry entries, one process
    assert from_arguments(DecodeConfig, argparse.Namespace(colocate="true")).colocate
    with pytest.raises(ValueError, match="--colocate: not a boolean"):
        from_arguments(DecodeConfig, argparse.Namespace(colocate="maybe"))


def test_a_heap_reserve_is_a_size_from_the_flag_or_env():
    assert DecodeConfig().heap_reserve_mb == 256 and PrefillConfig(heap_reserve_mb=0).heap_reserve_mb == 0
    with pytest.raises(ValueError, match="heap_reserve_mb must be >= 0"):
        DecodeConfig(heap_reserve_mb=-1)
    parser = argparse.ArgumentParser()
    add_arguments(parser, DecodeConfig)
    assert from_arguments(DecodeConfig, parser.parse_args(["--heap-reserve-mb", "64"])).heap_reserve_mb == 64


def test_a_boolean_that_defaults_on_has_a_no_flag():
    import argparse

    from pdq.config import DecodeConfig, add_arguments, from_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, DecodeConfig)
    assert from_arguments(DecodeConfig, parser.parse_args([])).prefix_cache
    assert not from_arguments(DecodeConfig, parser.parse_args(["--no-prefix-cache"])).prefix_cache
    assert not from_arguments(DecodeConfig, parser.parse_args(["--prefix-cache", "false"])).prefix_cache
    assert from_arguments(DecodeConfig, parser.parse_args(["--kv-block-size", "32"])).kv_block_size == 32
