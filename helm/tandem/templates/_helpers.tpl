{{/*
Names, labels and the pieces both workloads share. Every helper is prefixed `tandem.`.
*/}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Fully qualified name prefix of every object. Kept to 47 characters so that the longest
derived name, "<fullname>-engine-headless", still fits a 63-character DNS label.
*/}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.engine.fullname" -}}
{{- printf "%s-engine" (include "tandem.fullname" .) -}}
{{- end -}}

{{- define "tandem.engine.headlessServiceName" -}}
{{- printf "%s-engine-headless" (include "tandem.fullname" .) -}}
{{- end -}}

{{- define "tandem.frontend.fullname" -}}
{{- printf "%s-frontend" (include "tandem.fullname" .) -}}
{{- end -}}

{{- define "tandem.frontend.metricsServiceName" -}}
{{- printf "%s-frontend-metrics" (include "tandem.fullname" .) -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels shared by the selectors of both workloads; add a component label to tell them apart. */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.engine.selectorLabels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/component: engine
{{- end -}}

{{- define "tandem.frontend.selectorLabels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/component: frontend
{{- end -}}

{{- define "tandem.engine.labels" -}}
{{ include "tandem.labels" . }}
app.kubernetes.io/component: engine
{{- end -}}

{{- define "tandem.frontend.labels" -}}
{{ include "tandem.labels" . }}
app.kubernetes.io/component: frontend
{{- end -}}

{{/* commonAnnotations as a metadata block, or nothing. */}}
{{- define "tandem.annotations" -}}
{{- with .Values.commonAnnotations -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/*
Image reference. Usage: include "tandem.image" (dict "image" .Values.engine.image "context" $)
A digest wins over a tag; an empty tag means the chart's appVersion.
*/}}
{{- define "tandem.image" -}}
{{- $image := .image -}}
{{- $repository := $image.repository -}}
{{- if $image.registry -}}
{{- $repository = printf "%s/%s" $image.registry $image.repository -}}
{{- end -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (toString (default .context.Chart.AppVersion $image.tag)) -}}
{{- end -}}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Cluster DNS name of the engine headless Service. */}}
{{- define "tandem.engine.serviceFQDN" -}}
{{- printf "%s.%s.svc.%s" (include "tandem.engine.headlessServiceName" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/*
The frontend's --engine target. The headless Service resolves to the IPs of every ready
engine pod (publishNotReadyAddresses: false), and the frontend re-resolves it periodically,
so engines that scale out, restart or drain are picked up without touching the frontends.
*/}}
{{- define "tandem.engine.address" -}}
{{- printf "dns:///%s:%d" (include "tandem.engine.serviceFQDN" .) (int .Values.engine.containerPorts.grpc) -}}
{{- end -}}

{{/* Cluster DNS name of the frontend Service; the default name the TLS probe checks. */}}
{{- define "tandem.frontend.serviceFQDN" -}}
{{- printf "%s.%s.svc.%s" (include "tandem.frontend.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/*
Model source in effect: "demo" also when source=pvc names no claim, so a bare install runs.
*/}}
{{- define "tandem.engine.modelSource" -}}
{{- $model := .Values.engine.model -}}
{{- if and (eq $model.source "pvc") (not $model.pvc.claimName) -}}
demo
{{- else -}}
{{- $model.source -}}
{{- end -}}
{{- end -}}

{{/* Path given to --model. */}}
{{- define "tandem.engine.modelDir" -}}
{{- $model := .Values.engine.model -}}
{{- if $model.path -}}
{{- printf "%s/%s" (trimSuffix "/" $model.mountPath) (trimPrefix "/" $model.path) -}}
{{- else -}}
{{- $model.mountPath -}}
{{- end -}}
{{- end -}}

{{/* Seconds the kubelet waits between SIGTERM and SIGKILL on an engine. */}}
{{- define "tandem.engine.terminationGracePeriodSeconds" -}}
{{- $default := add (int .Values.engine.shutdownTimeout) 15 -}}
{{- default $default .Values.engine.terminationGracePeriodSeconds | int -}}
{{- end -}}

{{/* Frontends wait out the preStop sleep, then their in-flight streams, which the engines drain. */}}
{{- define "tandem.frontend.terminationGracePeriodSeconds" -}}
{{- $default := add (int .Values.frontend.preStopSleepSeconds) (int .Values.engine.shutdownTimeout) 15 -}}
{{- default $default .Values.frontend.terminationGracePeriodSeconds | int -}}
{{- end -}}

{{/* Secret the frontends present to engines (mTLS client side). */}}
{{- define "tandem.engine.clientTlsSecret" -}}
{{- default .Values.tls.engine.existingSecret .Values.tls.engine.clientExistingSecret -}}
{{- end -}}

{{/*
One probe. Usage:
  include "tandem.probe" (dict "probe" .Values.engine.startupProbe "port" 50051 "exec" $execCommand)
A plaintext port gets a native gRPC probe (grpc.health.v1; the whole server's status unless
the probe names a service). When the port serves TLS, "exec" holds the tandem-health-probe
command line, because kubelet's gRPC probe cannot do TLS.
*/}}
{{- define "tandem.probe" -}}
{{- if .exec }}
exec:
  command:
    {{- toYaml .exec | nindent 4 }}
{{- else }}
grpc:
  port: {{ int .port }}
  {{- with .probe.service }}
  service: {{ . | quote }}
  {{- end }}
{{- end }}
initialDelaySeconds: {{ int .probe.initialDelaySeconds }}
periodSeconds: {{ int .probe.periodSeconds }}
timeoutSeconds: {{ int .probe.timeoutSeconds }}
failureThreshold: {{ int .probe.failureThreshold }}
successThreshold: {{ int .probe.successThreshold }}
{{- end -}}

{{/* Environment shared by both containers; "component" is engine or frontend. */}}
{{- define "tandem.otelEnv" -}}
{{- $ctx := .context -}}
{{- if $ctx.Values.otel.endpoint }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: OTEL_SERVICE_NAME
  value: {{ printf "tandem-%s" .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  {{- $attributes := "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),service.instance.id=$(POD_NAME)" }}
  {{- if $ctx.Values.otel.resourceAttributes }}
  {{- $attributes = printf "%s,%s" $attributes $ctx.Values.otel.resourceAttributes }}
  {{- end }}
  value: {{ $attributes | quote }}
{{- end }}
{{- end -}}

{{/*
Checks the schema cannot express. Each check returns a message or nothing; any message
fails the render.
*/}}
{{- define "tandem.validateValues" -}}
{{- $messages := list -}}
{{- $messages = append $messages (include "tandem.validateValues.engineGracePeriod" . | trim) -}}
{{- $messages = append $messages (include "tandem.validateValues.frontendGracePeriod" . | trim) -}}
{{- $messages = append $messages (include "tandem.validateValues.livenessDuringDrain" . | trim) -}}
{{- $messages = append $messages (include "tandem.validateValues.model" . | trim) -}}
{{- $messages = append $messages (include "tandem.validateValues.kvCache" . | trim) -}}
{{- $messages = append $messages (include "tandem.validateValues.frontendTls" . | trim) -}}
{{- $messages = append $messages (include "tandem.validateValues.engineTls" . | trim) -}}
{{- $messages = append $messages (include "tandem.validateValues.autoscaling" . | trim) -}}
{{- $messages = append $messages (include "tandem.validateValues.pdb" . | trim) -}}
{{- $messages = append $messages (include "tandem.validateValues.ports" . | trim) -}}
{{- $messages = without $messages "" -}}
{{- $message := join "\n" $messages -}}
{{- if $message -}}
{{- printf "\nVALUES VALIDATION:\n%s" $message | fail -}}
{{- end -}}
{{- end -}}

{{- define "tandem.validateValues.engineGracePeriod" -}}
{{- $grace := int (include "tandem.engine.terminationGracePeriodSeconds" .) -}}
{{- if le $grace (int .Values.engine.shutdownTimeout) -}}
tandem: engine.terminationGracePeriodSeconds
    The grace period ({{ $grace }}s) must exceed engine.shutdownTimeout ({{ .Values.engine.shutdownTimeout }}s),
    or the kubelet kills engines while they still drain requests.
{{- end -}}
{{- end -}}

{{- define "tandem.validateValues.frontendGracePeriod" -}}
{{- $grace := int (include "tandem.frontend.terminationGracePeriodSeconds" .) -}}
{{- if le $grace (int .Values.frontend.preStopSleepSeconds) -}}
tandem: frontend.terminationGracePeriodSeconds
    The grace period ({{ $grace }}s) must exceed frontend.preStopSleepSeconds ({{ .Values.frontend.preStopSleepSeconds }}s).
{{- end -}}
{{- end -}}

{{/*
Servers report NOT_SERVING while they drain, and liveness checks the same health service, so
a liveness probe that gives up sooner than the drain would kill pods mid-drain.
*/}}
{{- define "tandem.validateValues.livenessDuringDrain" -}}
{{- range $component := list "engine" "frontend" -}}
{{- $probe := get (get $.Values $component) "livenessProbe" -}}
{{- $budget := mul (int $probe.periodSeconds) (int $probe.failureThreshold) -}}
{{- if and $probe.enabled (not $probe.service) (le (int $budget) (int $.Values.engine.shutdownTimeout)) -}}
tandem: {{ $component }}.livenessProbe
    periodSeconds x failureThreshold ({{ $budget }}s) must exceed engine.shutdownTimeout ({{ $.Values.engine.shutdownTimeout }}s):
    health reads NOT_SERVING while draining, and liveness must not kill a draining pod.
{{ end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.validateValues.model" -}}
{{- $model := .Values.engine.model -}}
{{- if and (eq $model.source "hostPath") (not $model.hostPath.path) -}}
tandem: engine.model.hostPath.path
    engine.model.source=hostPath needs the node directory that holds the model.
{{- else if and (eq $model.source "image") (not $model.image.reference) -}}
tandem: engine.model.image.reference
    engine.model.source=image needs the reference of the image that holds the model.
{{- end -}}
{{- end -}}

{{- define "tandem.validateValues.kvCache" -}}
{{- if and (gt (int64 .Values.engine.kvCache.numBlocks) 0) (gt (int64 .Values.engine.kvCache.bytes) 0) -}}
tandem: engine.kvCache
    Set engine.kvCache.numBlocks or engine.kvCache.bytes, not both.
{{- end -}}
{{- end -}}

{{- define "tandem.validateValues.frontendTls" -}}
{{- if and .Values.tls.frontend.enabled (not .Values.tls.frontend.existingSecret) -}}
tandem: tls.frontend.existingSecret
    tls.frontend.enabled needs the Secret holding the frontend's tls.crt, tls.key and ca.crt.
{{- end -}}
{{- end -}}

{{- define "tandem.validateValues.engineTls" -}}
{{- if and .Values.tls.engine.enabled (not .Values.tls.engine.existingSecret) -}}
tandem: tls.engine.existingSecret
    tls.engine.enabled needs the Secret holding the engines' tls.crt, tls.key and ca.crt.
{{- end -}}
{{- end -}}

{{- define "tandem.validateValues.autoscaling" -}}
{{- $hpa := .Values.frontend.autoscaling -}}
{{- if $hpa.enabled -}}
{{- if lt (int $hpa.maxReplicas) (int $hpa.minReplicas) -}}
tandem: frontend.autoscaling
    maxReplicas ({{ $hpa.maxReplicas }}) must be at least minReplicas ({{ $hpa.minReplicas }}).
{{- else if not (dig "requests" "cpu" "" .Values.frontend.resources) -}}
tandem: frontend.resources.requests.cpu
    The CPU autoscaler measures use against the CPU request; set one.
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.validateValues.pdb" -}}
{{- range $component := list "engine" "frontend" -}}
{{- $pdb := get (get $.Values $component) "pdb" -}}
{{- if and $pdb.create (not (include "tandem.isSet" $pdb.minAvailable)) (not (include "tandem.isSet" $pdb.maxUnavailable)) -}}
tandem: {{ $component }}.pdb
    Set minAvailable or maxUnavailable for the {{ $component }} PodDisruptionBudget.
{{ end -}}
{{- end -}}
{{- end -}}

{{/* "true" when a value is neither null nor the empty string (0 counts as set). */}}
{{- define "tandem.isSet" -}}
{{- if and (not (kindIs "invalid" .)) (ne (toString .) "") -}}true{{- end -}}
{{- end -}}

{{- define "tandem.validateValues.ports" -}}
{{- range $component := list "engine" "frontend" -}}
{{- $ports := get (get $.Values $component) "containerPorts" -}}
{{- if and $.Values.metrics.enabled (eq (int $ports.grpc) (int $ports.metrics)) -}}
tandem: {{ $component }}.containerPorts
    The {{ $component }}'s gRPC and metrics ports must differ.
{{ end -}}
{{- end -}}
{{- end -}}
