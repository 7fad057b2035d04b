"""A small Kubernetes distribution for development and tests: Kubernetes 1.20 built from
Debian's source, a control plane for the operator's tests, and a local cluster with two real
nodes for the end-to-end tier and `make cluster`. Standard library only: it runs from a bare
python3 as root (`PYTHONPATH=devcluster python3 -m shoal.devcluster ...`) as well as in pytest.

Modules (docs/control-plane.md, docs/cluster.md):
  layout         addresses, directories, each node's share of both
  procs          commands, long steps, supervised processes, progress lines, DevClusterError
  build          build.sh (the binaries, cached under $SHOAL_CACHE/k8s)
  pki            CA, serving certificate, service-account keys, tokens, kubeconfigs
  components     every component's command line and config files (pure)
  api            health checks and JSON lists over HTTPS (stdlib)
  control_plane  start/stop/health of etcd, kube-apiserver, kube-controller-manager(, scheduler)
  node, net, dns one node's host side; the bridge and namespaces; cluster DNS
  images         the images, built without a Docker daemon, and loading them into nodes
  clean          removing everything a run left on the host
  cluster        the cluster's supervisor, prepare, start, stop
  explain        why pods are not running, from the API's objects (pure)
  demo           what `make cluster` adds: model, chart, example, the completion check
  cli            python -m shoal.devcluster COMMAND
"""
