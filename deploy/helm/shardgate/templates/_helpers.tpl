{{/*
The operator's name, used for every object of the release: "<release>-operator" when the
release name contains "shardgate" (release "shardgate": shardgate-operator, as in
deploy/operator/), else "<release>-shardgate-operator"; or fullnameOverride.
*/}}
{{- define "shardgate.name" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains "shardgate" .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-shardgate-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "shardgate.selectorLabels" -}}
app.kubernetes.io/name: shardgate-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "shardgate.labels" -}}
{{ include "shardgate.selectorLabels" . }}
app.kubernetes.io/part-of: shardgate
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
The namespaced rules of what the operator does to ValkeyClusters and their children (in a
ClusterRole, or a Role in watchNamespace). The same as deploy/operator/rbac.yaml, which explains each.
*/}}
{{- define "shardgate.rules" -}}
- apiGroups: ["shardgate.io"]
  resources: ["valkeyclusters"]
  verbs: ["list", "watch"]
- apiGroups: ["shardgate.io"]
  resources: ["valkeyclusters/status"]
  verbs: ["patch"]
- apiGroups: ["shardgate.io"]
  resources: ["valkeyclusters/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "delete"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["tcproutes"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["gateways"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create", "patch", "delete"]
{{- end -}}

{{/*
The cluster-scoped rules: Nodes (their addresses, for NodePort endpoints). In the ClusterRole
after the rules above, or in a ClusterRole of their own with watchNamespace.
*/}}
{{- define "shardgate.clusterRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get"]
{{- end -}}
