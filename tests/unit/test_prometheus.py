"""mrl/prometheus.py: step metrics scraped from the real HTTP server, names, labels, last values, a
busy port; MetricsLogger's prometheus sink; the config check; the Grafana dashboard's queries."""

import json
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mrl.config import ConfigError, load_config
from mrl.metrics import MetricsLogger
from mrl.prometheus import PrometheusExporter, PrometheusPortError, metric_name, port_problem

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "mrl.json"

# Every metric a GRPO or PPO step logs (metrics.jsonl of the tiny recipes, plus the engine's
# throughput); tests/e2e/test_trainer.py checks the GRPO ones against a real run's endpoint.
PPO_ONLY = {"critic/grad_norm", "critic/lr", "critic/skipped", "critic/values_max", "critic/values_mean",
            "critic/values_min", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/vf_loss",
            "critic/vpred_mean", "timing_s/update_critic", "timing_s/values"}
STEP_METRICS = PPO_ONLY | {
    "actor/entropy", "actor/grad_norm", "actor/lr", "actor/pg_clipfrac", "actor/pg_loss", "actor/ppo_kl",
    "actor/ratio_max", "actor/ratio_mean", "actor/skipped", "actor/kl_loss", "actor/kept_sample_fraction", "actor/empty_step",
    "reward/errors", "reward/error_fraction",
    "critic/advantages_max", "critic/advantages_mean", "critic/advantages_min", "critic/returns_max",
    "critic/returns_mean", "critic/returns_min", "critic/score/max", "critic/score/mean", "critic/score/min",
    "eval/accuracy", "eval/accuracy_sampled", "perf/throughput", "perf/gen_tokens_per_s", "response_length/clip_ratio",
    "response_length/max", "response_length/mean", "rollout/logprob_abs_diff_max", "rollout/logprob_abs_diff_mean",
    "rollout/train_logprob_abs_diff_max", "rollout/train_logprob_abs_diff_mean", "rollout/train_kl", "sync/bytes", "sync/engine_load_s",
    "timing_s/gen", "timing_s/old_log_prob", "timing_s/reward", "timing_s/step", "timing_s/sync_weights",
    "timing_s/update_actor",
}


def scrape(port: int) -> dict[str, dict]:
    """{metric name: {"value", "labels", "help", "type"}} from the endpoint's text exposition."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        (sample,) = family.samples
        found[sample.name] = {"value": sample.value, "labels": sample.labels, "help": family.documentation,
                              "type": family.type}
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def exporter():
    exp = PrometheusExporter(0, "run-a")
    yield exp
    exp.close()


def test_names_are_sanitised_with_a_prefix():
    assert metric_name("actor/ppo_kl") == "mrl_actor_ppo_kl"
    assert metric_name("critic/score/mean") == "mrl_critic_score_mean"
    assert metric_name("timing_s/gen") == "mrl_timing_s_gen"
    assert metric_name("a-b.c d") == "mrl_a_b_c_d"


def test_scrape_gives_step_and_every_metric_as_a_gauge_labelled_with_the_run(exporter):
    assert scrape(exporter.port) == {}  # nothing logged yet: no series (not zeros)
    exporter.update(1, {"actor/ppo_kl": 0.25, "critic/score/mean": 0.5, "response_length/mean": 7})
    found = scrape(exporter.port)
    assert {name: m["value"] for name, m in found.items()} == {
        "mrl_step": 1, "mrl_actor_ppo_kl": 0.25, "mrl_critic_score_mean": 0.5, "mrl_response_length_mean": 7}
    assert all(m["labels"] == {"run": "run-a"} and m["type"] == "gauge" for m in found.values()), found
    assert "actor/ppo_kl" in found["mrl_actor_ppo_kl"]["help"]


def test_a_gauge_keeps_the_value_of_the_last_step_that_reported_it(exporter):
    exporter.update(1, {"actor/ppo_kl": 0.1, "eval/accuracy": 0.5})
    exporter.update(2, {"actor/ppo_kl": 0.2})
    found = scrape(exporter.port)
    assert found["mrl_step"]["value"] == 2 and found["mrl_actor_ppo_kl"]["value"] == 0.2
    assert found["mrl_eval_accuracy"]["value"] == 0.5


def test_two_names_that_become_one_gauge_are_refused(exporter):
    exporter.update(1, {"a/b": 1.0})
    with pytest.raises(ValueError, match=r"metrics 'a/b' and 'a_b' both become the Prometheus gauge mrl_a_b"):
        exporter.update(2, {"a_b": 2.0})


def test_a_busy_port_is_one_line_naming_the_port_and_the_fix(exporter):
    message = (f"logging.prometheus_port {exporter.port} is in use on this machine (another process listens "
               f"there): set logging.prometheus_port to a free port, 0 (any free port) or null (no exporter).")
    with pytest.raises(PrometheusPortError) as raised:
        PrometheusExporter(exporter.port, "run-b")
    assert str(raised.value) == message
    assert port_problem(exporter.port) == message


def test_close_frees_the_port():
    exp = PrometheusExporter(0, "run-a")
    port = exp.port
    exp.update(1, {"x": 1.0})
    assert scrape(port)["mrl_x"]["value"] == 1.0
    exp.close()
    exp.close()  # a second close does nothing
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    assert port_problem(port) is None
    PrometheusExporter(port, "run-b").close()  # the next run can take it


def test_metrics_logger_feeds_the_exporter_and_stops_it_on_close(tmp_path):
    port = free_port()
    with MetricsLogger(tmp_path, 2, tensorboard=False, progress=False, run_name="mine",
                       prometheus_port=port) as logger:
        logger.log(1, {"actor/ppo_kl": 0.5, "eval/accuracy": None})
        found = scrape(port)
    assert {name: (m["value"], m["labels"]) for name, m in found.items()} == {
        "mrl_step": (1, {"run": "mine"}), "mrl_actor_ppo_kl": (0.5, {"run": "mine"})}
    assert port_problem(port) is None


def test_config_checks_the_port_before_the_run(exporter):
    recipe = ROOT / "configs" / "tiny_cpu_grpo.yaml"
    assert load_config(recipe, ["logging.prometheus_port=0"]).logging.prometheus_port == 0
    with pytest.raises(ConfigError) as raised:
        load_config(recipe, [f"logging.prometheus_port={exporter.port}"])
    assert f"logging.prometheus_port {exporter.port} is in use on this machine" in str(raised.value)
    with pytest.raises(ConfigError, match=r"logging.prometheus_port must be in \[0, 65535\] \(or null: off\), "
                                          r"got 70000."):
        load_config(recipe, ["logging.prometheus_port=70000"])
    # A cluster recipe checked on a laptop: the port is the driver machine's business.
    load_config(recipe, [f"logging.prometheus_port={exporter.port}"], check_files=False)


def dashboard_metrics(dashboard: dict) -> set[str]:
    """Every mrl_* metric a panel's query names."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return {name for e in exprs for name in re.findall(r"\bmrl_[A-Za-z0-9_]+", e)}


def test_grafana_dashboard_queries_only_metrics_the_exporter_emits(exporter):
    dashboard = json.loads(DASHBOARD.read_text())
    exporter.update(3, {name: 1.0 for name in STEP_METRICS})
    emitted = set(scrape(exporter.port))
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 6
    missing = {p["title"]: sorted(dashboard_metrics({"panels": [p]}) - emitted) for p in panels}
    assert not {title: names for title, names in missing.items() if names}, missing
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'run=~"$run"' in target["expr"], (panel["title"], target["expr"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["query"]["query"] == "label_values(mrl_step, run)"
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("reward", "accuracy", "kl", "clip", "entropy", "length", "timing", "sync", "throughput"):
        assert topic in titles, topic
