"""``osft-train k8s-manifest``: the rendered PVC, headless Service and indexed Job agree with each
other and with the training flags, and the committed example is a fresh render."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from osft.trainer.exit_codes import EXIT_STOPPED
from osft.trainer.launch.cli import main
from osft.trainer.cluster.generator import CACHE_ENV

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kubernetes" / "osft-indexed-job.yaml"
TRAIN = ["--model-name-or-path", "/workspace/m", "--data-path", "/workspace/train.jsonl",
         "--output-dir", "/workspace/runs/x"]


def render(capsys, *argv) -> str:
    assert main(["k8s-manifest", *argv]) == 0
    return capsys.readouterr().out


def objects(text: str) -> dict:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(text) if doc}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_manifest_values_agree(capsys):
    text = render(capsys, *TRAIN, "--checkpoint-grace-seconds", "120", "--nodes", "3", "--gpus-per-node", "4",
                  "--image", "reg/osft:1", "--job-name", "ft", "--rdzv-port", "29400")
    docs = objects(text)
    assert set(docs) == {"PersistentVolumeClaim", "Service", "Job"}
    job, svc, pvc = docs["Job"], docs["Service"], docs["PersistentVolumeClaim"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == int(flag(args, "--nnodes")) == 3
    assert pod["terminationGracePeriodSeconds"] > 120
    assert flag(args, "--node-rank") == "$(NODE_RANK)"
    env = {e["name"]: e for e in container["env"]}
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == index
    # every cache is on the run volume (home and install directory may be read-only: tests/test_readonly_fs.py)
    caches = {name: e["value"] for name, e in env.items() if name != "NODE_RANK"}
    assert set(caches) == set(CACHE_ENV) and {"NUMBA_CACHE_DIR", "OSFT_DATA_CACHE", "HF_HOME"} <= set(caches)
    assert all(value.startswith("/workspace/runs/x/cache/") for value in caches.values())
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    # the rendezvous host is pod 0 of the Job under the headless Service that is the pods' subdomain
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"job-name": "ft"}
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert flag(args, "--rdzv-endpoint") == f"ft-0.{svc['metadata']['name']}:29400"
    assert svc["spec"]["ports"][0]["port"] == 29400
    assert "--on-demand-checkpointing" in args and "--resume" in args and flag(args, "--nproc-per-node") == "4"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4 and container["command"] == ["osft-train"]
    # the run directory is on the shared claim
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "runs"]
    assert flag(args, "--output-dir").startswith(mount["mountPath"] + "/")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "runs"]
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # a checkpoint stop and a disruption are not failures; bad input fails the Job
    rules = spec["podFailurePolicy"]["rules"]
    rules = {(r["action"], tuple(r.get("onExitCodes", {}).get("values", []))) for r in rules}
    assert ("Ignore", (EXIT_STOPPED,)) in rules and ("FailJob", (2,)) in rules
    assert pod["restartPolicy"] == "Never" and spec["backoffLimit"] == 6


def test_kubernetes_variable_syntax_in_flags_stays_literal(capsys):
    docs = objects(render(capsys, *TRAIN, "--osft-target-patterns", "$(HOME)", "--nodes", "1", "--gpus-per-node", "0",
                          "--image", "i"))
    (container,) = docs["Job"]["spec"]["template"]["spec"]["containers"]
    assert flag(container["args"], "--osft-target-patterns") == "$$(HOME)" and "resources" not in container


def kubernetes_expands(value: str) -> bool:
    """Whether Kubernetes would expand a variable reference in a command, argument or env value
    (``$$`` is a literal ``$``, ``$(NAME)`` a reference)."""
    return "$(" in value.replace("$$", "")


def test_values_are_yaml_strings_and_never_expanded(capsys):
    """Values are data in the manifest too (tests/test_slurm.py for the script): quotes, ``#``,
    ``:`` and ``$(...)`` in the values stay data."""
    out = '/work space/runs/a"b: #c $(HOME) $$(X) \\'
    argv = ["--model-name-or-path", "/work space/m", "--data-path", "/work space/d", "--output-dir", out,
            "--nodes", "1", "--gpus-per-node", "0", "--image", 'reg/x:1 #"y', "--mount-path", "/work space",
            "--pvc-size", "1Gi # 2: 3", "--storage-class", "a: b", "--launcher", "wrap $(HOME) osft-train"]
    docs = objects(render(capsys, *argv))
    pod = docs["Job"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == 'reg/x:1 #"y'
    assert container["command"] == ["wrap", "$$(HOME)", "osft-train"]
    assert flag(container["args"], "--output-dir").replace("$$", "$") == out
    assert flag(container["args"], "--node-rank") == "$(NODE_RANK)"  # the one reference the manifest means
    values = [*container["command"], *container["args"], *(e.get("value", "") for e in container["env"])]
    assert [v for v in values if kubernetes_expands(v)] == ["$(NODE_RANK)"]
    cache = {e["name"]: e["value"] for e in container["env"] if "value" in e}["OSFT_DATA_CACHE"]
    assert cache.replace("$$", "$") == out + "/cache/tokenized"
    assert {"name": "runs", "mountPath": "/work space"} in container["volumeMounts"]
    pvc = docs["PersistentVolumeClaim"]["spec"]
    assert pvc["resources"]["requests"]["storage"] == "1Gi # 2: 3" and pvc["storageClassName"] == "a: b"


@pytest.mark.parametrize("flags", [["--output-dir", "/workspace/x\n- y"], ["--image", "i\nkind: Pod"]])
def test_a_value_with_a_line_break_is_refused(capsys, flags):
    argv = [*TRAIN, "--nodes", "1", "--gpus-per-node", "0", "--image", "i"]
    argv[argv.index(flags[0]) + 1] = flags[1]
    with pytest.raises(SystemExit) as exc:
        main(["k8s-manifest", *argv])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == "" and "contains a control character" in captured.err


def test_committed_example_is_a_fresh_render(capsys):
    text = EXAMPLE.read_text()
    command = text.splitlines()[1].removeprefix("#   ")
    argv = shlex.split(command)
    assert argv[:2] == ["osft-train", "k8s-manifest"]
    assert render(capsys, *argv[2:]) == text, f"regenerate with: {command} > {EXAMPLE}"


@pytest.mark.parametrize(("flags", "message"), [
    (["--output-dir", "/data/runs/x"], "must be an absolute path under --mount-path /workspace"),
    (["--termination-grace-seconds", "300"], "must be longer than --checkpoint-grace-seconds 300"),
    (["--job-name", "My_Job"], "--job-name 'My_Job': lowercase letters"),
    (["--node-rank", "1"], "--node-rank is set by the generated job"),
    (["--nodes", "0"], "--nodes: expected a positive integer"),
])
def test_bad_flags_exit_2(capsys, flags, message):
    base = {"--nodes": "2", "--gpus-per-node": "1", "--image": "i"}
    argv = [*TRAIN]
    for name, value in zip(flags[::2], flags[1::2]):
        if name in base:
            base[name] = value
        elif name in argv:
            argv[argv.index(name) + 1] = value
        else:
            argv += [name, value]
    with pytest.raises(SystemExit) as exc:
        main(["k8s-manifest", *argv, *(x for kv in base.items() for x in kv)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
