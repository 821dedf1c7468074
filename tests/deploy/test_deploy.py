"""The deployment artefacts and the configuration reference, checked: the
Kubernetes manifests against the API schemas, the compose file and systemd
units against what the binaries accept, every example config by the binary
that reads it, and docs/configuration.md against the code."""

import configparser
import re
import subprocess
import tomllib
from pathlib import Path

import os

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def binary_dir():
    if os.environ.get("INFERYES_BIN_DIR"):
        return Path(os.environ["INFERYES_BIN_DIR"])
    return Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug"

DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.37.0"
BINARIES = ("inferyes-controller", "inferyes-dataplane", "inferyes-agent")


def binary_for(path):
    name = Path(path).name
    if "controller" in name:
        return "inferyes-controller"
    if "dataplane" in name:
        return "inferyes-dataplane"
    return "inferyes-agent"


def print_config(binary, path, env=None):
    return subprocess.run([str(binary_dir() / binary), "--config", str(path), "--print-config"],
                          capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})})


def env_vars(binary):
    help_text = subprocess.run([str(binary_dir() / binary), "--help"], capture_output=True, text=True,
                               check=True).stdout
    return set(re.findall(r"env: (INFERYES_[A-Z_]+)", help_text))


# ------------------------------------------------------------- kubernetes

def kustomization():
    return yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())


def test_every_kubernetes_resource_matches_the_api_schema():
    kinds = set()
    for name in kustomization()["resources"]:
        for document in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()):
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
            kinds.add(document["kind"])
    assert {"DaemonSet", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "StatefulSet", "Namespace", "NetworkPolicy"} <= kinds


def kubernetes_documents():
    return [d for name in kustomization()["resources"]
            for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text())]


def test_only_controllers_reach_etcd_s_clients_port_and_only_members_its_peers():
    documents = kubernetes_documents()
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
            for d in documents if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")}
    [policy] = [d for d in documents if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "inferyes-etcd"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["podSelector"]["matchLabels"].items() <= pods["inferyes-etcd"].items()
    allowed = {}
    for rule in spec["ingress"]:
        [source] = rule["from"]
        whose = [name for name, labels in pods.items() if source["podSelector"]["matchLabels"].items() <= labels.items()]
        for port in rule["ports"]:
            allowed.setdefault(port["port"], set()).update(whose)
    assert allowed == {2379: {"inferyes-controller"}, 2380: {"inferyes-etcd"}}, allowed
    # Its pods run as nobody, on a read-only root, with no service account.
    [etcd] = [d for d in documents if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "inferyes-etcd"]
    pod = etcd["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["automountServiceAccountToken"] is False
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"]


def test_the_schema_check_catches_a_mistake():
    broken = yaml.safe_load((DEPLOY / "kubernetes" / "controller.yaml").read_text().split("---")[0])
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = yaml.safe_load((DEPLOY / "kubernetes" / "controller.yaml").read_text().split("---")[0])
    broken["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_each_data_plane_lists_every_controller_kubernetes_runs():
    # Each controller splits the keys' limits among the data planes that
    # report to it: every data plane must reach every one, by its own name.
    [controllers] = [d for d in kubernetes_documents() if d["metadata"]["name"] == "inferyes-controller"
                     and d["kind"] == "StatefulSet"]
    [pods] = [d for d in kubernetes_documents() if d["kind"] == "Service"
              and d["metadata"]["name"] == controllers["spec"]["serviceName"]]
    assert pods["spec"]["clusterIP"] == "None"
    names = [f"http://inferyes-controller-{i}.{pods['metadata']['name']}:7070"
             for i in range(controllers["spec"]["replicas"])]
    config = tomllib.loads((DEPLOY / "kubernetes" / "config" / "dataplane.toml").read_text())
    assert config["controllers"] == names


def test_kubernetes_configs_are_accepted_by_their_binaries_and_wired_in():
    k = kustomization()
    generated = [f.split("=", 1)[1] for g in k["configMapGenerator"] + k["secretGenerator"] for f in g["files"]]
    for path in generated:
        result = print_config(binary_for(path), DEPLOY / "kubernetes" / path)
        assert result.returncode == 0, f"{path}: {result.stderr}"
    # Tokens are files from the inferyes-tokens Secret, mounted into the
    # pods whose configs name them and no others: never the environment
    # (one token, no rotation; shown to whoever may exec in the pod).
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in kubernetes_documents()
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")}
    for path in generated:
        config = tomllib.loads((DEPLOY / "kubernetes" / path).read_text())
        named = {v for key, v in config.items() if key.endswith("_token_file")}
        pod = pods[binary_for(path)]
        [container] = pod["containers"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounted = {f"{m['mountPath']}/{item['path']}"
                   for m in container["volumeMounts"]
                   if volumes[m["name"]].get("secret", {}).get("secretName") == "inferyes-tokens"
                   for item in volumes[m["name"]]["secret"]["items"]}
        assert named and named == mounted, (path, named, mounted)
    manifests = "\n".join((DEPLOY / "kubernetes" / name).read_text() for name in k["resources"])
    assert "_TOKEN\n" not in manifests and "secretKeyRef" not in manifests
    # Each container runs a binary with a config the generators provide.
    for binary, config in [("inferyes-controller", "controller.toml"), ("inferyes-dataplane", "dataplane.toml"),
                           ("inferyes-agent", "agent.toml")]:
        assert f"command: [{binary}, --config, /etc/inferyes/{config}]" in manifests
    image = k["images"][0]["name"]
    assert manifests.count(f"image: {image}\n") == 3
    # No pod holds a credential for the Kubernetes API: none of them uses it.
    assert all(pod.get("automountServiceAccountToken") is False for pod in pods.values()), pods.keys()
    # The agent, on the host network, listens on the node's cluster address
    # only, not on every interface of the host.
    [agent] = [d for d in kubernetes_documents() if d["metadata"]["name"] == "inferyes-agent"]
    env = {e["name"]: e.get("value") for e in agent["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert agent["spec"]["template"]["spec"]["hostNetwork"]
    assert env["INFERYES_PROXY_LISTEN"].startswith("$(HOST_IP):") and env["INFERYES_ADMIN_LISTEN"].startswith("$(HOST_IP):")
    # Environment variables set in the manifests are ones the binaries read.
    known = set().union(*(env_vars(b) for b in BINARIES))
    used = set(re.findall(r"name: (INFERYES_[A-Z_]+)", manifests))
    assert used and used <= known, used - known


# ---------------------------------------------------------------- compose

def test_the_compose_fleet_is_consistent():
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"etcd", "controller", "agent-a", "agent-b", "dataplane"} <= set(services)
    known = {b: env_vars(b) for b in BINARIES}
    for name, service in services.items():
        assert "image" in service, name
        for dependency in service.get("depends_on", []):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        command = service.get("command", [])
        if command and command[0] in known:
            binary = command[0]
            config = command[command.index("--config") + 1]
            local = DEPLOY / "local" / Path(config).name
            assert local.is_file(), f"{name}: {config} is mounted from deploy/local but missing"
            assert print_config(binary, local).returncode == 0
            unknown = set(service.get("environment", {})) - known[binary]
            assert not unknown, f"{name}: {binary} reads no {unknown}"
            assert service["ulimits"]["nofile"] >= 65_536, f"{name}: its open files limit"
    build = compose["x-inferyes"]["build"]
    assert (DEPLOY / "compose" / build["context"] / build["dockerfile"]).is_file()


# ------------------------------------------------------------------ image

def dockerfile_runs():
    """The build stage's RUN commands, each joined across its lines."""
    text = (DEPLOY / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    build = text.split("\nFROM ")[1]
    return [line.removeprefix("RUN ").strip() for line in build.splitlines() if line.startswith("RUN ")]


def test_the_image_ships_the_profile_optimised_build():
    """The image's binaries are those of scripts/pgo.sh, the recipe CI
    builds and checks and build-pgo.sh runs: not a plain build beside it."""
    runs = dockerfile_runs()
    assert any(r.startswith("scripts/deps.sh pgo") for r in runs), runs
    assert any("scripts/pgo.sh" in r and "--install-to /out" in r for r in runs), runs
    assert not any("cargo build" in r for r in runs), runs
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert "COPY --from=build /out/ /usr/local/bin/" in dockerfile
    assert 'exec "$(dirname "$0")/pgo.sh"' in (ROOT / "scripts" / "build-pgo.sh").read_text()
    test = (ROOT / "scripts" / "test.sh").read_text()
    assert re.search(r"scripts/pgo\.sh\" --packages dataplane .*--check", test), "CI does not check the recipe"


# ------------------------------------------------------------------- etcd

ETCD_FLAGS = ("--auto-compaction-mode=periodic", "--auto-compaction-retention=5m",
              "--quota-backend-bytes=2147483648")


def test_every_etcd_the_project_starts_compacts_and_has_a_quota():
    """Without compaction etcd keeps every revision until its quota, and
    past the quota it refuses every write: drains, keys, agents joining."""
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    statefulset = next(d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "etcd.yaml").read_text())
                       if d and d.get("kind") == "StatefulSet")
    started = {
        "compose": " ".join(compose["services"]["etcd"]["command"]),
        "kubernetes": " ".join(statefulset["spec"]["template"]["spec"]["containers"][0]["command"]),
    }
    for path in ("scripts/fleet.sh", "scripts/bench-proxy.sh", "scripts/pgo.sh", "tests/src/etcd.rs",
                 "tests/e2e/harness.py"):
        text = (ROOT / path).read_text()
        # Quoted and split across lines in scripts and code: compare the words.
        started[path] = " ".join(re.sub(r'["\',\\]', " ", text).split())
    for where, command in started.items():
        for flag in ETCD_FLAGS:
            assert flag in command or flag.replace("=", '" "') in command, f"{where}: etcd without {flag}"
    dropin = configparser.ConfigParser(strict=False, interpolation=None)
    dropin.optionxform = str
    dropin.read_string((DEPLOY / "systemd" / "etcd.service.d" / "inferyes.conf").read_text())
    environment = dropin["Service"]["Environment"]
    for flag in ETCD_FLAGS:
        name, value = flag.removeprefix("--").split("=")
        assert f"ETCD_{name.upper().replace('-', '_')}={value}" in environment, f"systemd drop-in without {flag}"


# ---------------------------------------------------------------- systemd

@pytest.mark.parametrize("binary", BINARIES)
def test_systemd_units_run_the_binary_hardened(binary):
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string((DEPLOY / "systemd" / f"{binary}.service").read_text())
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    service = unit["Service"]
    exec_start = service["ExecStart"].split()
    assert exec_start[0] == f"/usr/local/bin/{binary}"
    assert exec_start[1:3] == ["--config", f"/etc/inferyes/{binary.removeprefix('inferyes-')}.toml"]
    for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                       ("User", "inferyes"), ("KillSignal", "SIGTERM")]:
        assert service.get(key) == value, f"{binary}: {key}"
    assert service.get("CapabilityBoundingSet") == ""
    # The common default of 1,024 descriptors is under every listener's cap.
    assert int(service.get("LimitNOFILE", "0")) >= 65_536, f"{binary}: LimitNOFILE"
    if binary == "inferyes-agent":
        # The whole file system is read-only to it but what it must write:
        # the example's slots directory, where moved caches arrive.
        writable = {p.lstrip("-") for p in service.get("ReadWritePaths", "").split()}
        example = tomllib.loads((DEPLOY / "examples" / "single-box" / "agent.toml").read_text())
        slots = {b["slots"]["dir"] for b in example["backends"] if "slots" in b}
        assert slots and slots <= writable, (slots, writable)


def test_a_server_raises_its_open_files_limit_to_the_hard_one(tmp_path):
    import resource
    import time
    config = tmp_path / "dataplane.toml"
    config.write_text('version = 1\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
                      'controllers = ["http://127.0.0.1:9"]\n')
    hard = min(8192, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    server = subprocess.Popen(
        [str(binary_dir() / "inferyes-dataplane"), "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    try:
        limits = Path(f"/proc/{server.pid}/limits")
        soft = None
        for _ in range(100):
            line = next(l for l in limits.read_text().splitlines() if l.startswith("Max open files"))
            soft = int(line.split()[3])
            if soft == hard:
                break
            time.sleep(0.1)
        assert soft == hard, f"soft limit {soft}, hard {hard}"
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=30)
    # 4,096 connections, twice over, do not fit in 8,192 or less.
    assert "open files limit is below" in stderr, stderr



# ---------------------------------------------------------------- configs

@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (DEPLOY / "examples").rglob("*.toml"))
                         + sorted(str(p.relative_to(ROOT)) for p in (DEPLOY / "local").glob("*.toml")))
def test_example_configs_are_accepted(path):
    result = print_config(binary_for(path), ROOT / path)
    assert result.returncode == 0, result.stderr


def test_a_config_mistake_is_refused_with_what_to_fix(tmp_path):
    typo = tmp_path / "dataplane.toml"
    typo.write_text('version = 1\nlisten_addr = "0.0.0.0:8080"\n')
    result = print_config("inferyes-dataplane", typo)
    assert result.returncode != 0
    assert "listen_addr" in result.stderr
    bad = tmp_path / "controller.toml"
    bad.write_text("version = 1\nlease_ttl_ms = 500\n")
    result = print_config("inferyes-controller", bad)
    assert result.returncode != 0 and "lease_ttl_ms" in result.stderr and "2000" in result.stderr


def test_flags_beat_the_environment_which_beats_the_file(tmp_path):
    config = tmp_path / "dataplane.toml"
    config.write_text('version = 1\nlisten = "127.0.0.1:1001"\ndataplane_id = "from-file"\nmax_body_bytes = 7\n')
    run = lambda *flags, env: tomllib.loads(subprocess.run(  # noqa: E731
        [str(binary_dir() / "inferyes-dataplane"), "--config", str(config), "--print-config", *flags],
        capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin", **env}).stdout)
    assert run(env={})["listen"] == "127.0.0.1:1001"
    from_env = run(env={"INFERYES_LISTEN": "127.0.0.1:1002", "INFERYES_DATAPLANE_ID": "from-env"})
    assert (from_env["listen"], from_env["dataplane_id"], from_env["max_body_bytes"]) == ("127.0.0.1:1002", "from-env", 7)
    from_flag = run("--listen", "127.0.0.1:1003", env={"INFERYES_LISTEN": "127.0.0.1:1002"})
    assert from_flag["listen"] == "127.0.0.1:1003"


# ------------------------------------------------- the configuration reference

# Tables whose keys are the user's (model ids), documented as one option.
MAPS = {"backends[].model_sizes"}


def key_paths(value, prefix=""):
    paths = set()
    for key, item in value.items():
        path = f"{prefix}{key}"
        if isinstance(item, dict) and path not in MAPS:
            paths |= key_paths(item, f"{path}.")
        elif isinstance(item, list) and item and isinstance(item[0], dict):
            for element in item:
                paths |= key_paths(element, f"{path}[].")
        elif isinstance(item, list) and not item:
            # Empty: says nothing of its shape; other configs fill it.
            continue
        else:
            paths.add(path)
    return paths


def documented(section):
    text = (ROOT / "docs" / "configuration.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_.\[\]]+)` \|", body, re.M)), body


# Configs that between them use every option of their binary.
FULL_CONFIGS = {
    "inferyes-controller": ["deploy/examples/ha/controller.toml"],
    "inferyes-dataplane": ["deploy/examples/ha/dataplane.toml"],
    "inferyes-agent": ["deploy/examples/single-box/agent.toml", "deploy/examples/mixed-farm/mid-box-1.toml",
                       "deploy/examples/mixed-farm/big-box.toml",
                       "deploy/examples/ha/agent.toml",
                       "deploy/local/agent-b.toml", "deploy/local/agent-a.toml"],
}


@pytest.mark.parametrize("binary", BINARIES)
def test_the_configuration_reference_matches_the_code(binary):
    in_code = set()
    for path in FULL_CONFIGS[binary]:
        result = print_config(binary, ROOT / path)
        assert result.returncode == 0, result.stderr
        in_code |= key_paths(tomllib.loads(result.stdout))
    in_docs, body = documented(binary)
    assert in_code - in_docs == set(), f"options missing from docs/configuration.md: {in_code - in_docs}"
    # Documented options the code does not print at all (absent optional
    # fields print nothing) must still be ones it accepts.
    for option in in_docs - in_code:
        assert option in ALWAYS_OPTIONAL, f"docs/configuration.md lists `{option}`, which {binary} does not know"
    for variable in env_vars(binary) - {"INFERYES_CONFIG"}:
        assert variable in body, f"{variable} is not documented for {binary}"


# Options that --print-config omits when unset or empty.
ALWAYS_OPTIONAL = {"backends[].api_key", "backends[].api_key_file", "backends[].api_key_env", "backends[].models"}


# ---------------------------------------------------------------- grafana

def exposed_metrics():
    """Every series name the components register, with the suffixes the
    exposition adds (`_total` for counters, `_bucket`/`_sum`/`_count` for
    histograms)."""
    names = set()
    for component in ("dataplane", "agent", "controller"):
        source = (ROOT / component / "src" / "metrics.rs").read_text()
        prefix = re.search(r'sub_registry_with_prefix\("([a-z_]+)"\)', source).group(1)
        for name, field in re.findall(r'\.register\(\s*"([a-z_]+)",\s*"[^"]*",\s*(?:m|metrics)\.([a-z_]+)\.clone\(\)', source):
            declared = re.search(rf"\b{field}: (.+),\n", source).group(1)
            base = f"{prefix}_{name}"
            if "Histogram" in declared:
                names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
            elif re.search(r"\bCounter\b", declared):
                names.add(f"{base}_total")
            else:
                names.add(base)
    return names


def test_the_grafana_dashboard_uses_only_metrics_that_exist():
    import json
    dashboard = json.loads((DEPLOY / "grafana" / "inferyes-fleet.json").read_text())
    known = exposed_metrics()
    assert "inferyes_dataplane_requests_total" in known and "inferyes_agent_slots_busy" in known
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\binferyes_[a-z_]+", target["expr"]))
    assert used, "the dashboard queries nothing"
    assert used <= known, f"the dashboard queries series no component exposes: {used - known}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
