{{/*
The router's client-facing edge: TLS from a Secret, the plaintext health port the probes use
with TLS on, and the drain time on shutdown.
*/}}

{{/* Where the router reads its certificate, key and client CA (mounted from Secrets). */}}
{{- define "pdserve.apiTlsDir" -}}/etc/pdserve/api-tls{{- end }}
{{- define "pdserve.apiClientCADir" -}}/etc/pdserve/api-client-ca{{- end }}

{{/* `pdserve serve` flags of the edge (part of pdserve.serveArgs). */}}
{{- define "pdserve.routerEdgeArgs" -}}
{{- $r := .Values.router -}}
- --http-port
- {{ $r.httpPort | toString | quote }}
- --shutdown-grace-s
- {{ $r.shutdownGraceSeconds | toString | quote }}
{{- if $r.tls.enabled }}
- --tls-cert
- {{ include "pdserve.apiTlsDir" . }}/tls.crt
- --tls-key
- {{ include "pdserve.apiTlsDir" . }}/tls.key
{{- if $r.tls.requireClientCert }}
- --tls-client-ca
- {{ printf "%s/%s" (include "pdserve.apiClientCADir" .) $r.tls.clientCA.key | quote }}
{{- end }}
- --health-port
- {{ $r.tls.healthPort | toString | quote }}
{{- end }}
{{- end }}

{{/* One probe of the router (`probe`: startup, readiness or liveness; `timing`: its values):
gRPC health on the health port, or with probeProtocol=http GET /health (/ready for readiness)
on the HTTP port, over HTTPS when TLS is on (the kubelet does not verify the certificate). */}}
{{- define "pdserve.routerProbe" -}}
{{- $root := .root -}}
{{- if eq $root.Values.router.probeProtocol "http" -}}
httpGet:
  path: {{ ternary "/ready" "/health" (eq .probe "readiness") }}
  port: http
  scheme: {{ ternary "HTTPS" "HTTP" $root.Values.router.tls.enabled }}
{{ omit .timing "service" | toYaml }}
{{- else -}}
{{ include "pdserve.grpcProbe" (dict "port" (include "pdserve.healthPort" $root) "timing" .timing) }}
{{- end }}
{{- end }}

{{/* The port that answers grpc.health.v1 in plaintext: the API port, or with TLS on the
health-only port (the kubelet's gRPC probes cannot speak TLS). */}}
{{- define "pdserve.healthPort" -}}
{{- if .Values.router.tls.enabled }}{{ .Values.router.tls.healthPort }}{{ else }}{{ .Values.router.port }}{{ end }}
{{- end }}

{{/* Volumes of the router's TLS files. Mounted whole (no subPath), so the kubelet updates
them when cert-manager renews the Secret; the router serves new files from the next
connection on. */}}
{{- define "pdserve.apiTlsVolumes" -}}
{{- $tls := .Values.router.tls -}}
{{- if $tls.enabled -}}
- name: api-tls
  secret:
    secretName: {{ $tls.secretName }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- if $tls.requireClientCert }}
- name: api-client-ca
  secret:
    secretName: {{ $tls.clientCA.secretName | default $tls.secretName }}
    items:
      - {key: {{ $tls.clientCA.key }}, path: {{ $tls.clientCA.key }}}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.apiTlsVolumeMounts" -}}
{{- $tls := .Values.router.tls -}}
{{- if $tls.enabled -}}
- name: api-tls
  mountPath: {{ include "pdserve.apiTlsDir" . }}
  readOnly: true
{{- if $tls.requireClientCert }}
- name: api-client-ca
  mountPath: {{ include "pdserve.apiClientCADir" . }}
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/* The head pod's grace period: the router's drain plus time for it and Ray to exit. */}}
{{- define "pdserve.headTerminationGraceSeconds" -}}
{{- add .Values.router.shutdownGraceSeconds 15 }}
{{- end }}

{{/* preStop of the Ray head container: keep Ray (and so the worker actors' driver
connection) up while the router drains; the router's metrics port closes as it exits. */}}
{{- define "pdserve.rayHeadPreStop" -}}
exec:
  command:
    - /bin/bash
    - -c
    - {{ printf "for _ in $(seq %v); do (exec 3<>/dev/tcp/127.0.0.1/%v) 2>/dev/null || exit 0; sleep 1; done" (int .Values.router.shutdownGraceSeconds) .Values.router.metricsPort | quote }}
{{- end }}

{{/* Checks of the edge's values the schema cannot express. */}}
{{- define "pdserve.validateRouterEdge" -}}
{{- $r := .Values.router }}
{{- if and $r.tls.enabled (not $r.tls.secretName) }}
{{- fail "router.tls.enabled needs router.tls.secretName (a Secret with tls.crt and tls.key, e.g. from a cert-manager Certificate)" }}
{{- end }}
{{- if and $r.tls.requireClientCert (not $r.tls.enabled) }}
{{- fail "router.tls.requireClientCert needs router.tls.enabled" }}
{{- end }}
{{- if and $r.tls.enabled (has (int $r.tls.healthPort) (list (int $r.port) (int $r.metricsPort))) }}
{{- fail "router.tls.healthPort must differ from router.port and router.metricsPort" }}
{{- end }}
{{- if has (int $r.httpPort) (list (int $r.port) (int $r.metricsPort) (ternary (int $r.tls.healthPort) -1 $r.tls.enabled)) }}
{{- fail "router.httpPort must differ from router.port, router.metricsPort and router.tls.healthPort" }}
{{- end }}
{{- end }}
