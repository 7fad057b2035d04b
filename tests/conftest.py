"""Suite-wide fixtures, shared by every area through plugins in tests/support/.

- support.models: the project's own small models, built once per cache (`tiny_model`, `small_model`).
- support.controlplane: a real kube-apiserver + etcd + controller-manager, built once per cache
  and started once per session (`control_plane`).
"""

pytest_plugins = ["support.models", "support.controlplane"]
