{{/*
Names and labels.
Object names are cut to 40 characters: KubeRay derives longer names from the RayCluster's
(e.g. <name>-head-svc, <name>-prefill-worker-xxxxx) and those must stay within 63.
*/}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every object; call with (dict "root" $ "component" "router"). */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Selects the pods of one component; call with (dict "root" $ "component" "decode"). */}}
{{- define "pdserve.componentSelector" -}}
{{ include "pdserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* A NetworkPolicy peer matching every pod of this RayCluster (head, prefill, decode). */}}
{{- define "pdserve.rayPodsPeer" -}}
- podSelector:
    matchLabels:
      {{- include "pdserve.selectorLabels" . | nindent 6 }}
    matchExpressions:
      - key: app.kubernetes.io/component
        operator: In
        values: [head, prefill, decode]
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdserve.headServiceName" -}}
{{- printf "%s-head-svc" (include "pdserve.fullname" .) }}
{{- end }}

{{- define "pdserve.routerServiceName" -}}
{{- printf "%s-router" (include "pdserve.fullname" .) }}
{{- end }}

{{/*
Secrets. Each is either the user's existing Secret or one this chart generates.
*/}}
{{- define "pdserve.kvSecretName" -}}
{{- default (printf "%s-kv-transfer" (include "pdserve.fullname" .)) .Values.kvTransfer.existingSecret }}
{{- end }}

{{- define "pdserve.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "pdserve.fullname" .)) .Values.router.apiKeys.existingSecret }}
{{- end }}

{{- define "pdserve.redisSecretName" -}}
{{- default (printf "%s-redis" (include "pdserve.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{/*
A generated secret value (base64), stable across upgrades: reuse the value already stored in
the cluster (Helm `lookup`), else draw a new random one. Offline renders (`helm template`,
--dry-run) cannot look up, so they show a fresh value each time.
Call with (dict "root" $ "name" <secret name> "key" <data key>).
*/}}
{{- define "pdserve.generatedSecretValue" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name | default dict }}
{{- $data := get $existing "data" | default dict }}
{{- if hasKey $data .key }}
{{- index $data .key }}
{{- else }}
{{- randAlphaNum 48 | b64enc }}
{{- end }}
{{- end }}

{{/*
OpenTelemetry settings of every pdserve container. Ray worker processes inherit the environment
of the `ray start` that KubeRay runs, so the actors on a pool see their pod's variables; on top
of that the router copies its own OTEL_* and PDSERVE_* variables (but not OTEL_SERVICE_NAME or
OTEL_RESOURCE_ATTRIBUTES) into the actors' runtime_env (router/actors.py). Hence one
OTEL_SERVICE_NAME for all roles (each process adds its `pdserve.role`), and the per-pod resource
attributes (pod name, role) only on the Ray containers, never on the router, whose values would
otherwise overwrite the workers'. Call with (dict "root" $ "role" "prefill").
*/}}
{{- define "pdserve.otelEnv" -}}
{{- $tracing := .root.Values.tracing -}}
- name: OTEL_SERVICE_NAME
  value: {{ $tracing.serviceName | quote }}
{{- if ne .role "router" }}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME),pdserve.role=%s" .role | quote }}
{{- end }}
{{- if $tracing.enabled }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $tracing.otlpEndpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $tracing.otlpProtocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $tracing.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $tracing.samplerArg | toString | quote }}
{{- else }}
- name: OTEL_TRACES_EXPORTER
  value: none
{{- end }}
{{- end }}

{{/* The shared KV-transfer secret: the router (which hands it to the actors) and the workers. */}}
{{- define "pdserve.kvSecretEnv" -}}
- name: PDSERVE_KV_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.kvSecretName" . }}
      key: {{ .Values.kvTransfer.secretKey }}
{{- end }}

{{/* PDSERVE_REDIS_URL for the router, which passes it to the workers; bundled or external.
An environment variable, not a flag: argv (and the password in the URL) is visible in ps. */}}
{{- define "pdserve.redisEnv" -}}
{{- if .Values.redis.enabled -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: {{ .Values.redis.auth.passwordKey }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s-redis:6379/0" (include "pdserve.fullname" .) | quote }}
{{- else -}}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.urlKey }}
{{- end }}
{{- end }}

{{/* The model volume, if any (read-only); call with the root context. */}}
{{- define "pdserve.modelVolume" -}}
{{- with .Values.model }}
{{- if .pvc.claimName -}}
- name: model
  persistentVolumeClaim:
    claimName: {{ .pvc.claimName }}
    readOnly: true
{{- else if .hostPath -}}
- name: model
  hostPath:
    path: {{ .hostPath }}
    type: Directory
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.modelVolumeMount" -}}
{{- with .Values.model }}
{{- if or .pvc.claimName .hostPath -}}
- name: model
  mountPath: {{ .mountPath }}
  readOnly: true
  {{- if and .pvc.claimName .pvc.subPath }}
  subPath: {{ .pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The --model argument: mountPath/dir, or nothing for the built-in tiny model. */}}
{{- define "pdserve.modelPath" -}}
{{- with .Values.model }}
{{- if or .pvc.claimName .hostPath }}
{{- if .dir }}{{ printf "%s/%s" (trimSuffix "/" .mountPath) (trimPrefix "/" .dir) }}{{ else }}{{ .mountPath }}{{ end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The pool's Ray custom resources as a `ray start --resources` parameter, in KubeRay's quoting
convention: KubeRay pastes the value into a shell command line, so it is the JSON object
wrapped in double quotes with its inner quotes escaped: '"{\"prefill_pool\":1}"'.
Each worker requires 1 unit (a TP-N worker's N rank actors 1/N each), so a pod hosts exactly
workersPerPod workers of its pool.
*/}}
{{- define "pdserve.rayResources" -}}
{{- $resources := dict .poolResource (int .workersPerPod) }}
{{- printf "\"%s\"" (toJson $resources | replace "\"" "\\\"") | squote }}
{{- end }}

{{/* Pod resources of a pool: the values' CPU/memory plus workersPerPod x tp x gpusPerWorker
GPUs (each of a worker's tp rank actors takes gpusPerWorker of them). */}}
{{- define "pdserve.workerResources" -}}
{{- $resources := deepCopy .resources -}}
{{- $gpus := mul .workersPerPod (.tp | default 1) .gpusPerWorker }}
{{- if gt (int $gpus) 0 }}
{{- $limits := get $resources "limits" | default dict }}
{{- $_ := set $limits "nvidia.com/gpu" (int $gpus) }}
{{- $_ := set $resources "limits" $limits }}
{{- $requests := get $resources "requests" | default dict }}
{{- $_ := set $requests "nvidia.com/gpu" (int $gpus) }}
{{- $_ := set $resources "requests" $requests }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/*
One KubeRay worker group. Prefill and decode are the same pod shape with different values, so
both are this helper called with the role: (dict "root" $ "role" "prefill").
The container runs no command of ours: KubeRay starts the Ray node from rayStartParams, and
the router (the Ray driver) places the worker actors here through the pool resource.
*/}}
{{- define "pdserve.workerGroup" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $spec := index $root.Values $role -}}
- groupName: {{ $role }}
  replicas: {{ $spec.replicas }}
  minReplicas: {{ $spec.minReplicas }}
  maxReplicas: {{ $spec.maxReplicas }}
  rayStartParams:
    {{- with $spec.rayStartParams }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    resources: {{ include "pdserve.rayResources" $spec }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" (dict "root" $root "component" $role) | nindent 8 }}
      {{- with $spec.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $spec.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $spec.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $spec.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          securityContext:
            allowPrivilegeEscalation: false
          env:
            {{- include "pdserve.otelEnv" (dict "root" $root "role" $role) | nindent 12 }}
            {{- include "pdserve.kvSecretEnv" $root | nindent 12 }}
            {{- with $spec.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- include "pdserve.workerResources" $spec | nindent 12 }}
          volumeMounts:
            - name: shared-mem
              mountPath: /dev/shm
            {{- with include "pdserve.modelVolumeMount" $root }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with include "pdserve.kvTlsVolumeMount" $root }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- if $root.Values.kvCache.diskGb }}
            - name: kv-disk
              mountPath: {{ include "pdserve.kvDiskDir" $root }}
            {{- end }}
      volumes:
        - name: shared-mem
          emptyDir:
            medium: Memory
            sizeLimit: {{ $spec.shmSize }}
        {{- with include "pdserve.modelVolume" $root }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with include "pdserve.kvTlsVolume" $root }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- if $root.Values.kvCache.diskGb }}
        # The disk tier of this pod's workers (they share it: a directory per run), no larger
        # than their budgets together.
        - name: kv-disk
          emptyDir:
            sizeLimit: {{ printf "%vGi" (mulf $spec.workersPerPod $root.Values.kvCache.diskGb) }}
        {{- end }}
{{- end }}

{{/* Where worker pods mount their disk tier (kvCache.diskGb): the same path on every pod, as
the router passes it to the worker actors it creates, wherever Ray places them. */}}
{{- define "pdserve.kvDiskDir" -}}/var/lib/pdserve/kv-disk{{- end }}

{{/* The KV TLS Secret, at the same path on every worker pod: the router passes the paths
to the worker actors it creates, wherever Ray places them. Mounted whole (no subPath), so the
kubelet updates the files when cert-manager renews the Secret. */}}
{{- define "pdserve.kvTlsDir" -}}/etc/pdserve/kv-tls{{- end }}

{{- define "pdserve.kvTlsVolume" -}}
{{- if .Values.kvTransfer.tls.enabled -}}
- name: kv-tls
  secret:
    secretName: {{ .Values.kvTransfer.tls.secretName }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end }}

{{- define "pdserve.kvTlsVolumeMount" -}}
{{- if .Values.kvTransfer.tls.enabled -}}
- name: kv-tls
  mountPath: {{ include "pdserve.kvTlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
`pdserve serve` flags of the router. One list item per argv word, so no shell quoting is
involved. The Redis URL comes from the env (PDSERVE_REDIS_URL), never from argv.
*/}}
{{- define "pdserve.serveArgs" -}}
{{- $v := .Values -}}
- pdserve
- serve
- --ray-address
- auto
- --port
- {{ $v.router.port | toString | quote }}
- --metrics-port
- {{ $v.router.metricsPort | toString | quote }}
- --prefill-workers
- {{ mul $v.prefill.replicas $v.prefill.workersPerPod | toString | quote }}
- --decode-workers
- {{ mul $v.decode.replicas $v.decode.workersPerPod | toString | quote }}
- --gpus-per-worker
- {{ $v.prefill.gpusPerWorker | toString | quote }}
{{- if ne (int ($v.prefill.tp | default 1)) 1 }}
- --prefill-tp
- {{ $v.prefill.tp | toString | quote }}
{{- end }}
{{- if ne (int ($v.decode.tp | default 1)) 1 }}
- --decode-tp
- {{ $v.decode.tp | toString | quote }}
{{- end }}
{{- if $v.model.expertParallel }}
- --expert-parallel
{{- end }}
- --kv-transport
- {{ $v.kvTransfer.transport }}
{{- with $v.kvTransfer.nixlUcxTls }}
- --kv-nixl-ucx-tls
- {{ . | quote }}
{{- end }}
{{- with $v.kvTransfer.tls }}
{{- if .enabled }}
{{- $dir := include "pdserve.kvTlsDir" $ }}
- --kv-tls-cert
- {{ printf "%s/tls.crt" $dir | quote }}
- --kv-tls-key
- {{ printf "%s/tls.key" $dir | quote }}
- --kv-tls-ca
- {{ printf "%s/ca.crt" $dir | quote }}
{{- if not .requireClientCert }}
- --no-kv-tls-client-auth
{{- end }}
{{- with .serverName }}
- --kv-tls-server-name
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- if $v.kvCache.offloadGb }}
- --kv-offload-gb
- {{ $v.kvCache.offloadGb | toString | quote }}
{{- end }}
{{- if $v.kvCache.diskGb }}
- --kv-disk-dir
- {{ include "pdserve.kvDiskDir" . | quote }}
- --kv-disk-gb
- {{ $v.kvCache.diskGb | toString | quote }}
{{- end }}
- --ttft-slo-ms
- {{ $v.router.ttftSloMs | toString | quote }}
- --tpot-slo-ms
- {{ $v.router.tpotSloMs | toString | quote }}
{{- if $v.router.planIntervalSeconds }}
- --plan-interval
- {{ $v.router.planIntervalSeconds | toString | quote }}
{{- end }}
{{- if $v.router.peerPull }}
- --peer-pull
{{- end }}
{{- if $v.router.hybrid }}
{{- if $v.router.roleSwitching.enabled }}
{{- fail "router.hybrid and router.roleSwitching.enabled are not supported together" }}
{{- end }}
- --hybrid
{{- end }}
{{- if $v.router.roleSwitching.enabled }}
{{- if not $v.router.planIntervalSeconds }}
{{- fail "router.roleSwitching.enabled needs router.planIntervalSeconds (the plan it acts on)" }}
{{- end }}
- --role-switching
- --role-switch-dwell-s
- {{ $v.router.roleSwitching.dwellSeconds | toString | quote }}
- --role-switch-margin
- {{ $v.router.roleSwitching.margin | toString | quote }}
- --role-switch-drain-s
- {{ $v.router.roleSwitching.drainSeconds | toString | quote }}
{{- end }}
- --log-format
- {{ $v.router.logFormat }}
- --log-level
- {{ $v.router.logLevel }}
{{- with include "pdserve.modelPath" . }}
- --model
- {{ . | quote }}
{{- end }}
{{- if ne $v.prefill.poolResource "prefill_pool" }}
- --prefill-pool-resource
- {{ $v.prefill.poolResource | quote }}
{{- end }}
{{- if ne $v.decode.poolResource "decode_pool" }}
- --decode-pool-resource
- {{ $v.decode.poolResource | quote }}
{{- end }}
{{ include "pdserve.routerEdgeArgs" . }}
{{- range $v.router.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* A native gRPC probe on the router port with the timing from values. */}}
{{- define "pdserve.grpcProbe" -}}
grpc:
  port: {{ .port }}
  {{- with .timing.service }}
  service: {{ . | quote }}
  {{- end }}
{{ omit .timing "service" | toYaml }}
{{- end }}

{{/* Checks the JSON schema cannot express; fails the render with a message that says why. */}}
{{- define "pdserve.validate" -}}
{{- $v := .Values }}
{{- range $role := list "prefill" "decode" }}
{{- $spec := index $v $role }}
{{- if or (gt (int $spec.minReplicas) (int $spec.replicas)) (gt (int $spec.replicas) (int $spec.maxReplicas)) }}
{{- fail (printf "%s: need minReplicas <= replicas <= maxReplicas (got %v <= %v <= %v)" $role $spec.minReplicas $spec.replicas $spec.maxReplicas) }}
{{- end }}
{{- if hasKey $spec.rayStartParams "resources" }}
{{- fail (printf "%s.rayStartParams.resources is set by the chart from %s.poolResource; remove it" $role $role) }}
{{- end }}
{{- end }}
{{- if ne (int $v.prefill.gpusPerWorker) (int $v.decode.gpusPerWorker) }}
{{- fail "prefill.gpusPerWorker and decode.gpusPerWorker must be equal: `pdserve serve` takes one --gpus-per-worker" }}
{{- end }}
{{- if eq $v.prefill.poolResource $v.decode.poolResource }}
{{- fail "prefill.poolResource and decode.poolResource must differ, or the pools would mix" }}
{{- end }}
{{- if and $v.model.pvc.claimName $v.model.hostPath }}
{{- fail "model: set either pvc.claimName or hostPath, not both" }}
{{- end }}
{{- if and (not $v.redis.enabled) (not $v.redis.external.existingSecret) }}
{{- fail "redis.enabled=false needs redis.external.existingSecret (a Secret with the Redis URL)" }}
{{- end }}
{{- end }}
