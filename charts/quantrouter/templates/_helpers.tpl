{{/* Chart name, truncated to the 63 characters a label value may have. */}}
{{- define "quantrouter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects. The release name is used alone when it already contains
the chart name, so `helm install quantrouter ...` gives `quantrouter`, not
`quantrouter-quantrouter`.
*/}}
{{- define "quantrouter.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "quantrouter.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "quantrouter.labels" -}}
helm.sh/chart: {{ include "quantrouter.chart" . }}
app.kubernetes.io/name: {{ include "quantrouter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: quantrouter
{{- end }}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "router"). */}}
{{- define "quantrouter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "quantrouter.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Selector labels of one vLLM tier: include with (dict "ctx" $ "tier" "fp16"). */}}
{{- define "quantrouter.tierSelectorLabels" -}}
{{ include "quantrouter.selectorLabels" (dict "ctx" .ctx "component" "vllm") }}
quantrouter.io/tier: {{ .tier }}
{{- end }}

{{- define "quantrouter.serviceAccountName" -}}
{{- if eq .Values.mode "sidecar" }}
{{- .Values.sidecar.serviceAccountName }}
{{- else if .Values.serviceAccount.create }}
{{- default (include "quantrouter.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "quantrouter.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "quantrouter.tiersNamespace" -}}
{{- default .Release.Namespace .Values.tiersNamespace }}
{{- end }}

{{- define "quantrouter.profilesConfigMap" -}}
{{- default (printf "%s-profiles" (include "quantrouter.fullname" .)) .Values.profiles.existingConfigMap }}
{{- end }}

{{- define "quantrouter.redisName" -}}
{{- printf "%s-redis" (include "quantrouter.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret holding the Redis password, or "" when there is none. */}}
{{- define "quantrouter.redisPasswordSecret" -}}
{{- if .Values.redis.auth.enabled }}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else if .Values.redis.enabled }}
{{- include "quantrouter.redisName" . }}
{{- end }}
{{- end }}
{{- end }}

{{/* The hosts and path of the Redis URL, or "" when the router runs without Redis. */}}
{{- define "quantrouter.redisAddress" -}}
{{- if .Values.redis.enabled }}
{{- printf "%s.%s.svc:6379" (include "quantrouter.redisName" .) .Release.Namespace }}
{{- else if .Values.redis.url }}
{{- regexReplaceAll "^rediss?(\\+(sentinel|cluster))?://" .Values.redis.url "" }}
{{- end }}
{{- end }}

{{/* The Redis URL's scheme: redis, rediss, redis+sentinel, rediss+cluster... */}}
{{- define "quantrouter.redisScheme" -}}
{{- default "redis" (regexFind "^rediss?(\\+(sentinel|cluster))?" .Values.redis.url) }}
{{- end }}

{{/*
Environment variables giving the router its Redis URL. The password never appears in the pod
spec: it comes from a Secret into REDIS_PASSWORD, and Kubernetes expands $(REDIS_PASSWORD)
inside QUANTROUTER_REDIS_URL (the variable must be defined first).
*/}}
{{- define "quantrouter.redisEnv" -}}
{{- if .Values.redis.existingUrlSecret.name }}
- name: QUANTROUTER_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingUrlSecret.name }}
      key: {{ .Values.redis.existingUrlSecret.key }}
{{- else }}
{{- $address := include "quantrouter.redisAddress" . }}
{{- if $address }}
{{- $scheme := include "quantrouter.redisScheme" . }}
{{- $secret := include "quantrouter.redisPasswordSecret" . }}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .Values.redis.auth.existingSecretPasswordKey }}
- name: QUANTROUTER_REDIS_URL
  value: {{ printf "%s://:$(REDIS_PASSWORD)@%s" $scheme $address | quote }}
{{- else }}
- name: QUANTROUTER_REDIS_URL
  value: {{ printf "%s://%s" $scheme $address | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.redis.sentinelPasswordSecret.name }}
- name: QUANTROUTER_REDIS_SENTINEL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.sentinelPasswordSecret.key }}
{{- end }}
{{- end }}

{{/* Seconds the kubelet allows between the start of preStop and SIGKILL. */}}
{{- define "quantrouter.terminationGracePeriodSeconds" -}}
{{- $s := .Values.router.shutdown }}
{{- add $s.preStopSleepSeconds (divf $s.delayMs 1000 | ceil) (divf $s.graceMs 1000 | ceil) 5 | int }}
{{- end }}

{{/*
The router container, shared by the gateway Deployment and the sidecar snippet so the two
cannot drift. Include with (dict "ctx" $ "sidecar" true|false).
*/}}
{{- define "quantrouter.container" -}}
{{- $ := .ctx }}
{{- $v := $.Values }}
{{- $http := ternary "qr-http" "http" .sidecar }}
{{- $admin := ternary "qr-admin" "admin" .sidecar }}
name: quantrouter
image: {{ include "quantrouter.image" $ }}
imagePullPolicy: {{ $v.image.pullPolicy }}
{{- if .sidecar }}
# A native sidecar (an init container that keeps running): it starts, and passes
# its startup probe, before the application's containers, and stops after them.
restartPolicy: Always
{{- end }}
args:
  - --listen={{ ternary $v.sidecar.listen (printf "0.0.0.0:%v" $v.service.port) .sidecar }}
  - --admin-listen=0.0.0.0:{{ $v.service.adminPort }}
  - --profiles=/etc/quantrouter/profiles.json
  - --redis-prefix={{ $v.redis.prefix }}
  {{- if $v.router.apiKeys.existingSecret }}
  - --api-keys-file=/var/run/secrets/quantrouter/api-keys/{{ $v.router.apiKeys.key }}
  {{- end }}
  {{- if $v.router.tenants.existingConfigMap }}
  - --tenants=/etc/quantrouter-tenants/{{ $v.router.tenants.key }}
  {{- end }}
  - --tenant-metrics-top={{ $v.router.tenants.metricsTop }}
  - --log-format={{ $v.router.logFormat }}
  - --discovery={{ $v.router.discovery }}
  - --workers={{ $v.router.workers }}
  {{- with $v.router.maxConnections }}
  - --max-connections={{ . }}
  {{- end }}
  - --shutdown-delay-ms={{ $v.router.shutdown.delayMs }}
  - --shutdown-grace-ms={{ $v.router.shutdown.graceMs }}
  {{- range $v.router.modelAliases }}
  - --model-alias={{ . }}
  {{- end }}
  {{- range $v.router.extraArgs }}
  - {{ . | quote }}
  {{- end }}
{{- $env := include "quantrouter.redisEnv" $ }}
env:
  {{- with $env }}
  {{- . | trim | nindent 2 }}
  {{- end }}
  {{- /* Upstream API keys: only ever from a Secret, named by the profiles' api_key_env. */}}
  {{- range $v.router.upstreamApiKeys }}
  - name: {{ .name }}
    valueFrom:
      secretKeyRef:
        name: {{ .secretName }}
        key: {{ .secretKey | default "api-key" }}
  {{- end }}
  # The scaler port has no authentication: served only where KEDA's external trigger uses it.
  - name: QUANTROUTER_KEDA_SCALER_LISTEN
    {{- if include "quantrouter.externalScaler" $ }}
    value: "0.0.0.0:{{ $v.keda.external.port }}"
    {{- else }}
    value: "off"
    {{- end }}
  {{- if eq $v.mode "epp" }}
  # The endpoint picker the InferencePool's endpointPickerRef names (Envoy ext_proc, h2c).
  - name: QUANTROUTER_EPP_LISTEN
    value: "0.0.0.0:{{ $v.epp.port }}"
  {{- end }}
  {{- with $v.router.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
ports:
  - name: {{ $http }}
    containerPort: {{ $v.service.port }}
    protocol: TCP
  - name: {{ $admin }}
    containerPort: {{ $v.service.adminPort }}
    protocol: TCP
  {{- if include "quantrouter.externalScaler" $ }}
  - name: keda
    containerPort: {{ $v.keda.external.port }}
    protocol: TCP
  {{- end }}
  {{- if eq $v.mode "epp" }}
  - name: epp
    containerPort: {{ $v.epp.port }}
    protocol: TCP
  {{- end }}
startupProbe:
  httpGet:
    path: /healthz
    port: {{ $admin }}
  periodSeconds: 1
  failureThreshold: 30
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ $admin }}
  periodSeconds: 10
  timeoutSeconds: 2
  failureThreshold: 3
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ $admin }}
  periodSeconds: 2
  timeoutSeconds: 2
  failureThreshold: 1
{{- if gt (int $v.router.shutdown.preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    # The sleep action needs no shell in the (distroless) image.
    sleep:
      seconds: {{ $v.router.shutdown.preStopSleepSeconds }}
{{- end }}
resources:
  {{- toYaml $v.router.resources | nindent 2 }}
securityContext:
  {{- toYaml $v.router.securityContext | nindent 2 }}
volumeMounts:
  # The whole directory, not a subPath, so ConfigMap edits reach the watched file.
  - name: quantrouter-profiles
    mountPath: /etc/quantrouter
    readOnly: true
  {{- if $v.router.apiKeys.existingSecret }}
  - name: quantrouter-api-keys
    mountPath: /var/run/secrets/quantrouter/api-keys
    readOnly: true
  {{- end }}
  {{- if $v.router.tenants.existingConfigMap }}
  - name: quantrouter-tenants
    mountPath: /etc/quantrouter-tenants
    readOnly: true
  {{- end }}
  - name: quantrouter-tmp
    mountPath: /tmp
{{- end }}

{{/* The volumes the router container mounts. */}}
{{- define "quantrouter.volumes" -}}
- name: quantrouter-profiles
  configMap:
    name: {{ include "quantrouter.profilesConfigMap" . }}
{{- if .Values.router.apiKeys.existingSecret }}
- name: quantrouter-api-keys
  secret:
    secretName: {{ .Values.router.apiKeys.existingSecret }}
{{- end }}
{{- if .Values.router.tenants.existingConfigMap }}
- name: quantrouter-tenants
  configMap:
    name: {{ .Values.router.tenants.existingConfigMap }}
{{- end }}
- name: quantrouter-tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end }}

{{/* "true" when some managed tier is scaled through the router's external scaler. */}}
{{- define "quantrouter.externalScaler" -}}
{{- if and .Values.keda.enabled (eq .Values.keda.trigger "external") (ne .Values.mode "sidecar") }}true{{ end }}
{{- end }}

{{/* One tier's settings: tierDefaults overridden by the tier. (dict "ctx" $ "tier" $tier) */}}
{{- define "quantrouter.tierValues" -}}
{{- toYaml (mustMergeOverwrite (deepCopy .ctx.Values.tierDefaults) (deepCopy .tier)) }}
{{- end }}

{{/* The vLLM Service/Deployment name of a tier: (dict "ctx" $ "name" "fp16" "tier" $tier). */}}
{{- define "quantrouter.tierName" -}}
{{- default (printf "vllm-%s" .name) .tier.service | trunc 63 | trimSuffix "-" }}
{{- end }}
