"""The Kubernetes operator: the `DynServeDeployment` and `DynServePool` resources (`spec.py`, `crd.py`), pure
builders of every child manifest (`builders.py`), and kopf handlers that apply them and report status
(`handlers.py`). It builds manifests and never runs models: it imports no torch and no Ray."""
