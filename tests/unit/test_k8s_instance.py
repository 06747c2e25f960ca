"""deploy/k8s/dagster.yaml loads the way Dagster loads an instance, builds a run pod with
dagster-k8s, and stays the repository's dagster.yaml apart from the run launcher and run
monitoring. No cluster and no database: nothing here connects to either."""

import importlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from dagster import DagsterInvalidConfigError, DagsterRun
from dagster._config import process_config, resolve_to_config_type, validate_config
from dagster._core.instance.ref import InstanceRef
from dagster._core.launcher import RunLauncher
from dagster._serdes import ConfigurableClassData
from dagster_k8s import K8sRunLauncher
from dagster_k8s.container_context import K8sContainerContext
from dagster_k8s.job import construct_dagster_k8s_job

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "deploy" / "k8s"
# The only top-level keys in which the fleet's instance differs from the repository's.
FLEET_ONLY = {"run_launcher", "run_monitoring"}
PG_URL = "postgresql+psycopg2://tq:secret@db.internal:5432/crawler_dagster"


@pytest.fixture
def k8s_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # What deploy/k8s/dagster.yaml reads from the environment (the tq-pipelines-env secret).
    monkeypatch.setenv("TQ_DAGSTER_PG_URL", PG_URL)


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig for a cluster that is never contacted: K8sRunLauncher.__init__ loads kube
    config (in-cluster by default, which needs a service account token on disk) and builds API
    clients, but sends no request until it launches, checks or terminates a run."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
                "users": [{"name": "u", "user": {"token": "unused"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    default = kubernetes.client.Configuration._default
    yield path
    # load_kube_config replaces the process-wide default client configuration.
    kubernetes.client.Configuration._default = default


def load(config_dir: Path, base_dir: Path) -> tuple[InstanceRef, dict[str, Mapping[str, Any]]]:
    """What DagsterInstance.from_config checks before it connects to anything: the instance
    schema (InstanceRef.from_dir), then each configured class's own schema with env vars
    resolved, as ConfigurableClassData.rehydrate does. Returns the ref and, by class name, the
    config each class would be built from."""
    ref = InstanceRef.from_dir(str(base_dir), config_dir=str(config_dir))
    resolved = {}
    for data in (ref.storage_data, ref.run_coordinator_data, ref.run_launcher_data):
        assert data is not None
        klass = getattr(importlib.import_module(data.module_name), data.class_name)
        result = process_config(resolve_to_config_type(klass.config_type()), data.config_dict)
        if not result.success:
            raise DagsterInvalidConfigError(
                f"Errors in the config of {data.module_name}.{data.class_name}",
                result.errors,
                data.config_dict,
            )
        resolved[data.class_name] = result.value
    return ref, resolved


def test_the_k8s_instance_loads_with_the_k8s_run_launcher(k8s_env: None, tmp_path: Path) -> None:
    ref, resolved = load(K8S_DIR, tmp_path)

    assert resolved["DagsterPostgresStorage"]["postgres_url"] == PG_URL
    assert "QueuedRunCoordinator" in resolved
    launcher = ref.run_launcher_data
    assert launcher is not None
    assert (launcher.module_name, launcher.class_name) == ("dagster_k8s", "K8sRunLauncher")
    assert validate_config(K8sRunLauncher.config_type(), launcher.config_dict).success
    assert ref.settings["run_monitoring"]["enabled"] is True


def test_the_k8s_run_launcher_builds_the_run_pod(k8s_env: None, tmp_path: Path, kubeconfig: Path) -> None:
    ref, _ = load(K8S_DIR, tmp_path)
    data = ref.run_launcher_data
    assert data is not None
    config = data.config_dict
    # The fleet's daemon loads in-cluster config; outside a cluster, the kubeconfig above.
    outside = ConfigurableClassData(
        data.module_name,
        data.class_name,
        yaml.safe_dump({**config, "load_incluster_config": False, "kubeconfig_file": str(kubeconfig)}),
    )
    launcher = outside.rehydrate(as_type=RunLauncher)
    assert isinstance(launcher, K8sRunLauncher)
    # What run monitoring asks the launcher: is this run's pod alive?
    assert launcher.supports_check_run_worker_health

    # The Kubernetes Job that launch_run would create for a drain run, up to the API call.
    run = DagsterRun(job_name="drain_tasks_job", run_id="7f0c2a1e-0000-4000-8000-000000000000")
    context = K8sContainerContext.create_for_run(run, launcher, include_run_tags=True)
    job = construct_dagster_k8s_job(
        job_config=context.get_k8s_job_config(job_image=None, run_launcher=launcher),
        args=["dagster", "api", "execute_run"],
        job_name="dagster-run-7f0c2a1e",
        pod_name="dagster-run-7f0c2a1e",
        component="run_worker",
        user_defined_k8s_config=context.run_k8s_config,
    )
    assert context.namespace == config["job_namespace"]
    pod = job.spec.template.spec
    assert pod.service_account_name == config["service_account_name"]
    (container,) = pod.containers
    assert container.image == config["job_image"]
    resources = config["run_k8s_config"]["container_config"]["resources"]
    assert resources["requests"] and resources["limits"]
    assert container.resources.requests == resources["requests"]
    assert container.resources.limits == resources["limits"]
    assert [source.secret_ref.name for source in container.env_from] == config["env_secrets"]

    # TQ_PLATFORMS_FILE lies in a read-only mount of a ConfigMap volume.
    env = {var.name: var.value for var in container.env}
    platforms_file = Path(env["TQ_PLATFORMS_FILE"])
    (mount,) = [m for m in container.volume_mounts if Path(m.mount_path) == platforms_file.parent]
    assert mount.read_only
    (volume,) = [v for v in pod.volumes if v.name == mount.name]
    assert volume.config_map is not None


def test_the_k8s_instance_is_the_repository_instance_but_for_the_launcher() -> None:
    fleet = yaml.safe_load((K8S_DIR / "dagster.yaml").read_text())
    local = yaml.safe_load((REPO / "dagster.yaml").read_text())
    assert fleet.keys() >= FLEET_ONLY
    assert {k: v for k, v in fleet.items() if k not in FLEET_ONLY} == {
        k: v for k, v in local.items() if k not in FLEET_ONLY
    }


@pytest.mark.parametrize(
    ("correct", "misspelled"),
    [
        ("\nrun_monitoring:", "\nrun_monitorng:"),  # the instance schema
        ("  poll_interval_seconds:", "  poll_interval_second:"),  # the instance schema, nested
        ("    postgres_url:", "    postgres_uri:"),  # DagsterPostgresStorage
        ("    dequeue_interval_seconds:", "    dequeue_interval_second:"),  # QueuedRunCoordinator
        ("    job_namespace:", "    job_namespce:"),  # K8sRunLauncher
        ("      container_config:", "      containr_config:"),  # K8sRunLauncher, nested
    ],
)
def test_a_misspelled_key_fails_to_load(k8s_env: None, tmp_path: Path, correct: str, misspelled: str) -> None:
    text = (K8S_DIR / "dagster.yaml").read_text()
    assert text.count(correct) == 1
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "dagster.yaml").write_text(text.replace(correct, misspelled))
    key = misspelled.strip().rstrip(":")
    with pytest.raises(DagsterInvalidConfigError, match=f'unexpected config entry "{key}"'):
        load(broken, tmp_path)
