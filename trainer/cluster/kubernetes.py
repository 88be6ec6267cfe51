"""``osft-train k8s-manifest``: a Kubernetes manifest for a multi-node run, no operator needed.

Three objects, applied together with ``kubectl apply -f``:

- a PersistentVolumeClaim (``ReadWriteMany``) for the run directory, which every node writes and
  every restarted pod resumes from;
- a headless Service (``clusterIP: None``) that gives each pod of the Job the DNS name
  ``<job>-<index>.<service>``; pod 0's name and ``--rdzv-port`` are the c10d rendezvous endpoint;
- an indexed Job (``completionMode: Indexed``, ``parallelism = completions = nodes``): pod *i*
  runs ``osft-train ... --nnodes N --node-rank i --on-demand-checkpointing --resume``, the index
  read from the pod's ``batch.kubernetes.io/job-completion-index`` annotation.

Kubernetes stops a pod (deletion, preemption, eviction, node drain, a suspended Job) with SIGTERM,
then SIGKILL after ``terminationGracePeriodSeconds``, which is ``--checkpoint-grace-seconds`` plus a
margin here: ``osft-train`` checkpoints and exits with code 75 within it. The Job's
``podFailurePolicy`` does not count exit code 75 or a disruption as a failure, and replaces the pod,
which resumes; exit code 2 (bad input) fails the Job at once. Needs Kubernetes 1.26 or newer.

Every cache (tokenized data, numba, Hugging Face, ``datasets``, Triton, TorchInductor, matplotlib)
goes to ``<output_dir>/cache/`` on the claim (:data:`osft.trainer.cluster.generator.CACHE_ENV`), so the pods run with a
read-only root file system and any home directory. Values from the command line are written as YAML
strings, with ``$`` doubled in the container's command, arguments and environment (Kubernetes
expands ``$(VAR)`` there); a value with a control character is refused (exit 2).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath

from .generator import (GRACE_MARGIN_S, TrainJob, cache_env, check_printable, cluster_parser, non_negative_int,
                      parse_train_flags, positive_int)
from ..exit_codes import EXIT_BAD_INPUT, EXIT_STOPPED

#: A DNS-1123 label: what Job, Service and pod host names must be.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

#: Name of the training container (``podFailurePolicy`` rules name it).
CONTAINER = "osft"


@dataclass(frozen=True)
class K8sJob:
    """The scheduler side of a generated manifest (times in seconds, sizes in Kubernetes quantities)."""

    nodes: int
    gpus_per_node: int
    image: str
    termination_grace_seconds: int
    job_name: str = "osft"
    rdzv_port: int = 29500
    pvc_name: str = "osft-runs"
    pvc_size: str = "100Gi"
    storage_class: str | None = None
    mount_path: str = "/workspace"
    backoff_limit: int | None = None  # None: 2 x nodes

    @property
    def backoff(self) -> int:
        """The Job's ``backoffLimit``: :attr:`backoff_limit`, or two failed attempts of every node."""
        return 2 * self.nodes if self.backoff_limit is None else self.backoff_limit

    @property
    def service(self) -> str:
        """Name of the headless Service (the pods' DNS subdomain)."""
        return f"{self.job_name}-nodes"

    @property
    def rdzv_endpoint(self) -> str:
        """``host:port`` of the rendezvous: pod 0 of the Job, under the Service."""
        return f"{self.job_name}-0.{self.service}:{self.rdzv_port}"


def _flow_list(words: list[str], indent: str) -> str:
    """A YAML flow sequence of strings, one flag with its values per line."""
    lines: list[list[str]] = []
    for word in words:
        if not lines or word.startswith("--"):
            lines.append([])
        lines[-1].append(json.dumps(word))
    body = ",\n".join(f"{indent}  " + ", ".join(line) for line in lines)
    return f"[\n{body},\n{indent}]"


def _literal(text: str) -> str:
    """``text`` as a command, argument or environment value that Kubernetes leaves as it is: it
    expands ``$(VAR)`` there and reads ``$$`` as ``$``."""
    return text.replace("$", "$$")


def _check(job: K8sJob, train: TrainJob, generated_by: list[str]) -> None:
    """Raises ValueError: a control character in a value, a name Kubernetes rejects, or a run
    directory outside the shared volume."""
    check_printable([*generated_by, train.config.output_dir])
    for what, name in (("--job-name", job.job_name), ("--pvc-name", job.pvc_name)):
        if not _DNS_LABEL.match(name):
            raise ValueError(f"{what} {name!r}: lowercase letters, digits and '-' only, starting and ending "
                             "with a letter or digit")
    longest = max(len(job.service), len(f"{job.job_name}-{job.nodes - 1}"), len(job.pvc_name))
    if longest > 63:
        raise ValueError(f"--job-name {job.job_name!r} is too long: Service and pod host names have at most "
                         "63 characters")
    mount = PurePosixPath(job.mount_path)
    out = PurePosixPath(train.config.output_dir)
    if not mount.is_absolute() or not out.is_absolute() or not out.is_relative_to(mount) or out == mount:
        raise ValueError(f"--output-dir {out} must be an absolute path under --mount-path {mount}: every node and "
                         "every restarted pod needs the run directory on the shared volume")
    if job.termination_grace_seconds <= train.config.checkpoint_grace_seconds:
        raise ValueError(f"--termination-grace-seconds {job.termination_grace_seconds} must be longer than "
                         f"--checkpoint-grace-seconds {train.config.checkpoint_grace_seconds}, or Kubernetes kills "
                         "the pods before the checkpoint is saved")


def render_indexed_job(job: K8sJob, train: TrainJob, generated_by: list[str]) -> str:
    """The manifest (PVC, headless Service, indexed Job) of ``job`` running ``train``, as YAML.

    Args:
        generated_by: the command line that generated it (written in a comment).

    Raises:
        ValueError: a name Kubernetes rejects, an ``--output-dir`` outside ``--mount-path``, or a
            termination grace period not longer than ``--checkpoint-grace-seconds``.
    """
    _check(job, train, generated_by)
    words = [_literal(w) for w in train.argv]
    args = _flow_list([*words, *train.node_flags(str(job.nodes), job.rdzv_endpoint, "$(NODE_RANK)")], " " * 10)
    command = "[" + ", ".join(json.dumps(_literal(w)) for w in train.launcher) + "]"
    caches = "".join(f"\n            - name: {name}\n              value: {json.dumps(_literal(path))}"
                     for name, path in cache_env(train.config.output_dir).items())
    storage_class = f"\n  storageClassName: {json.dumps(job.storage_class)}" if job.storage_class else ""
    gpus = f"""
          resources:
            limits:
              nvidia.com/gpu: {job.gpus_per_node}""" if job.gpus_per_node else ""
    nproc, grace = train.config.nproc_per_node, train.config.checkpoint_grace_seconds
    return f"""# osft-train on {job.nodes} node(s) x {nproc} rank(s) as a Kubernetes indexed Job. Generated by:
#   {shlex.join(generated_by)}
# Apply with: kubectl apply -f THIS_FILE   (see examples/kubernetes/README.md)
---
# The run directory (metrics, logs, checkpoints, exports) on storage every node mounts: the nodes
# write one checkpoint together, and a replacement pod resumes from it.
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {job.pvc_name}
spec:
  accessModes: [ReadWriteMany]{storage_class}
  resources:
    requests:
      storage: {json.dumps(job.pvc_size)}
---
# Headless Service: DNS names <job>-<index>.{job.service} for the Job's pods. Pod 0's name is the
# rendezvous endpoint of every node; it resolves as soon as pod 0 has an address.
apiVersion: v1
kind: Service
metadata:
  name: {job.service}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    job-name: {job.job_name}
  ports:
    - name: rendezvous
      port: {job.rdzv_port}
---
apiVersion: batch/v1
kind: Job
metadata:
  name: {job.job_name}
spec:
  completionMode: Indexed  # pod i gets index i: its --node-rank
  completions: {job.nodes}
  parallelism: {job.nodes}
  backoffLimit: {job.backoff}  # failures other than the ones ignored below
  podFailurePolicy:
    rules:
      - action: Ignore  # stopped after a complete checkpoint: a new pod with the same index resumes
        onExitCodes:
          containerName: {CONTAINER}
          operator: In
          values: [{EXIT_STOPPED}]
      - action: Ignore  # preempted, evicted or drained: the pod is replaced
        onPodConditions:
          - type: DisruptionTarget
      - action: FailJob  # bad flags, data or model: a retry cannot help
        onExitCodes:
          containerName: {CONTAINER}
          operator: In
          values: [{EXIT_BAD_INPUT}]
  template:
    spec:
      subdomain: {job.service}
      restartPolicy: Never  # the Job replaces a stopped pod (podFailurePolicy needs Never)
      # SIGTERM, then SIGKILL this many seconds later: the checkpoint gets --checkpoint-grace-seconds
      # ({grace}) and the launcher {job.termination_grace_seconds - grace} s more to shut down.
      terminationGracePeriodSeconds: {job.termination_grace_seconds}
      containers:
        - name: {CONTAINER}
          image: {json.dumps(job.image)}
          command: {command}
          args: {args}
          env:
            - name: NODE_RANK
              valueFrom:
                fieldRef:
                  fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
            # every cache on the run volume: the image's home and install directory may be read-only{caches}{gpus}
          volumeMounts:
            - name: runs
              mountPath: {json.dumps(job.mount_path)}
            - name: shm  # the ranks' shared memory and checkpoint requests; the default 64 MiB is too small
              mountPath: /dev/shm
            - name: tmp  # temporary files, writable with a read-only root file system
              mountPath: /tmp
      volumes:
        - name: runs
          persistentVolumeClaim:
            claimName: {job.pvc_name}
        - name: shm
          emptyDir:
            medium: Memory
        - name: tmp
          emptyDir: {{}}
"""


def main(argv: list[str]) -> int:
    """``osft-train k8s-manifest [training flags] --nodes N --gpus-per-node G --image IMAGE ...``:
    print the manifest to stdout; returns 0.

    Raises:
        SystemExit: exit code 2 with argparse's usage and error line for a bad flag.
    """
    prog = "osft-train k8s-manifest"
    parser = cluster_parser(prog, "Print a Kubernetes manifest (PVC, headless Service, indexed Job) that runs "
                                  "osft-train on N pods, checkpoints on SIGTERM and resumes in a replacement pod.")
    parser.add_argument("--image", required=True, help="container image with osft installed")
    parser.add_argument("--rdzv-port", type=positive_int, default=29500,
                        help="rendezvous port on pod 0 (default: 29500)")
    parser.add_argument("--pvc-name", default="osft-runs", help="PersistentVolumeClaim of the run directory "
                                                                "(default: osft-runs)")
    parser.add_argument("--pvc-size", default="100Gi", help="its size (default: 100Gi)")
    parser.add_argument("--storage-class", default=None, help="its storage class; it must offer ReadWriteMany "
                                                              "(default: the cluster's default class)")
    parser.add_argument("--mount-path", default="/workspace", help="where the pods mount it; --output-dir must be "
                                                                   "under it (default: /workspace)")
    parser.add_argument("--termination-grace-seconds", type=positive_int, default=None,
                        help="seconds between SIGTERM and SIGKILL "
                             f"(default: --checkpoint-grace-seconds + {GRACE_MARGIN_S})")
    parser.add_argument("--backoff-limit", type=non_negative_int, default=None,
                        help="pod failures tolerated besides checkpoint stops and disruptions; a failure on one node "
                             "usually fails every node (default: 2 x --nodes, two failed attempts of the whole job)")
    args, train_argv = parser.parse_known_args(argv)
    train = parse_train_flags(prog, train_argv, args.gpus_per_node, args.launcher)
    grace = args.termination_grace_seconds or train.config.checkpoint_grace_seconds + GRACE_MARGIN_S
    job = K8sJob(args.nodes, args.gpus_per_node, args.image, grace, args.job_name, args.rdzv_port, args.pvc_name,
                 args.pvc_size, args.storage_class, args.mount_path, args.backoff_limit)
    try:
        manifest = render_indexed_job(job, train, ["osft-train", "k8s-manifest", *argv])
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(manifest)
    return 0
