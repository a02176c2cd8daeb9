{{/* Chart name, possibly overridden. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Base name of every resource: the release name, plus the chart name unless it is
already part of it. Kept short enough for "-operator-metrics" to fit 63 characters. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 46 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 46 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 46 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of the operator's Deployment, ServiceAccount and RBAC objects. */}}
{{- define "tandem.operator" -}}
{{- printf "%s-operator" (include "tandem.fullname" .) -}}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.operator" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end -}}

{{/* Labels that select the operator pods. */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* What the controller calls, and nothing else (docs/install.md maps each rule to its
call site in operator/src/controller.rs). Server-side apply of an object that does not
exist yet is authorized as create as well as patch. */}}
{{- define "tandem.controllerRules" -}}
- apiGroups: [tandem.dev]
  resources: [pddeployments]
  verbs: [get, list, watch]
- apiGroups: [tandem.dev]
  resources: [pddeployments/status]
  verbs: [patch]
# Owned objects carry blockOwnerDeletion: true, which the OwnerReferencesPermissionEnforcement
# admission plugin allows only to whoever may update the owner's finalizers.
- apiGroups: [tandem.dev]
  resources: [pddeployments/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, patch, delete]
# The node of a member pod: Ready not True means its kubelet stopped reporting (a pod there
# is removed with the short grace and force-deleted without a margin). Cluster-scoped: with
# watchNamespace (a Role) this grants nothing and the operator judges by pod conditions.
- apiGroups: [""]
  resources: [nodes]
  verbs: [get]
# The tandem.dev/group-ready readiness gate of decode pods.
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [services]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch, create, patch, delete]
# Group keys: created once per group and never patched; read back (get) only to sign an
# in-place reset of the group's members (docs/in-place-reset.md). The lists are metadata only.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, list, watch, create, delete]
# spec.router: the router's Deployment, Service (above), ServiceAccount, and a Role and
# RoleBinding that grant its pods get/list/watch of their PDDeployment and list/watch of
# pods, which this role holds itself (so no escalate or bind is needed). Applied and
# deleted, never listed: the router's Service stands for them in the Service list.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [create, patch, delete]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [create, patch, delete]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
