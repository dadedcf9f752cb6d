"""Conformance: the official tinker SDK 0.38.0 drives a live `ember serve` through spec §7 stages
1-9 (stage 7, sampling, checks the clear 501 until the engine has a sampler); each scenario runs in
its own subprocess. The engine-death scenario runs last because it loses every model."""

from tests.conformance.conftest import run_scenario


def test_stage1_bootstrap(server):
    run_scenario(server, "s1_bootstrap")


def test_stage2_3_session_model_and_supervised_numerics(server):
    run_scenario(server, "s2_train_numerics")


def test_stage4_chunking_ordering_zstd(server):
    run_scenario(server, "s4_chunking")


def test_stage5_rl_losses(server):
    run_scenario(server, "s5_rl_losses")


def test_stage5b_stable_reinforce_with_the_stability_record(server):
    run_scenario(server, "s5_stable_reinforce")


def test_openai_compatible_endpoints_with_the_openai_client(server):
    run_scenario(server, "s_openai")


def test_stage6_custom_losses_client_and_server_side(server):
    run_scenario(server, "s6_custom_loss")


def test_stage8_checkpoints_resume_rest_and_isolation(server):
    run_scenario(server, "s8_checkpoints")


def test_stage7_sampling(server):
    run_scenario(server, "s7_sampling")


def test_stage9_lifecycle(server):
    run_scenario(server, "s9_lifecycle")
    assert '"path": "/api/v1/telemetry"' in server.log.read_text()


def test_two_clients_train_concurrently_and_get_what_they_get_alone(server):
    run_scenario(server, "s_multitenant")


def test_stage7_sampling_with_retrieve_futures_and_join(server):
    """The flag run of stage 7: sample_use_retrieve_futures + sample_join_sampling_session."""
    run_scenario(server, "s7_flags")


def test_jwt_auth_flag_run(server):
    """Flag pjwt_auth_enabled: the SDK trains and samples on JWTs it got from auth/token."""
    run_scenario(server, "s_jwt")
    log = (server.log.parent / "api-jwt.log").read_text()
    assert '"path": "/api/v1/auth/token", "status": 200' in log, log[-3000:]


def test_stage7_cancel_future_through_the_sdk(server):
    """An abandoned sample: the SDK sends cancel_future and the request ends cancelled."""
    run_scenario(server, "s7_cancel")
    cancels = [line for line in server.log.read_text().splitlines() if '"/api/v1/cancel_future"' in line]
    assert cancels and all('"status": 200' in line for line in cancels), cancels


def test_full_finetuning_through_the_sdk(server):
    """rank 0 on a --full-finetune server: trains, samples, snapshots, resumes, exports; LoRA
    tenants unaffected; wrong checkpoint kinds and servers without the flag refuse clearly."""
    run_scenario(server, "s_full_finetune")


def test_engine_death_fails_pending_requests_and_restarts(server):
    """Last: it loses every model of the Qwen3 engine."""
    run_scenario(server, "s_engine_death")
