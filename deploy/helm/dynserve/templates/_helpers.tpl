{{/*
Names, labels, the image and the operator's RBAC rules, shared by every template.
*/}}

{{/* The chart's name, or nameOverride. */}}
{{- define "dynserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>" (the release's name alone when it already holds the chart's), or fullnameOverride. */}}
{{- define "dynserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := include "dynserve.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The operator's objects' name. */}}
{{- define "dynserve.operator.fullname" -}}
{{- printf "%s-operator" (include "dynserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "dynserve.operator.serviceAccountName" -}}
{{- default (include "dynserve.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- end }}

{{/* The kopf peering object's name (the operator's --peering). */}}
{{- define "dynserve.operator.peeringName" -}}
{{- default (include "dynserve.fullname" .) .Values.operator.peering.name }}
{{- end }}

{{/* The selector labels: they never change over a release's life. Call with (dict "ctx" $ "component" "..."). */}}
{{- define "dynserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dynserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every object's labels. Call with (dict "ctx" $ "component" "..."). */}}
{{- define "dynserve.labels" -}}
{{ include "dynserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: dynserve
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The image's tag: image.tag, else the chart's appVersion. */}}
{{- define "dynserve.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/* The image reference: repository:tag, pinned @digest when image.digest is given. */}}
{{- define "dynserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (include "dynserve.imageTag" .) }}
{{- with .Values.image.digest }}@{{ . }}{{ end }}
{{- end }}

{{/*
The operator's rules on namespaced resources (a ClusterRole's when it watches every namespace, else each
watched namespace's Role). Kept to the verbs it uses: it creates the Role and RoleBinding that let a
deployment's planner scale its DynServePools, so it holds those rights itself.
*/}}
{{- define "dynserve.operator.namespacedRules" -}}
- apiGroups: ["dynserve.io"]
  resources: ["dynservedeployments"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["dynserve.io"]
  resources: ["dynservedeployments/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["dynserve.io"]
  resources: ["dynservepools"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["dynserve.io"]
  resources: ["dynservepools/status", "dynservepools/scale"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
{{- end }}

{{/* The operator's rules on cluster-scoped resources, whatever it watches: it reads the CRDs (kopf's scan). */}}
{{- define "dynserve.operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- end }}

{{/* The operator's rights on its peering object: kopf reads it and patches its keep-alive into the status. */}}
{{- define "dynserve.operator.peeringRule" -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ .resource | quote }}]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
