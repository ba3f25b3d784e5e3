{{/* The release's name prefix: the release name, or RELEASE-pdq when it does not hold "pdq". */}}
{{- define "pdq.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Pods of one role: dict "root" $ "role" "scheduler". */}}
{{- define "pdq.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "pdq.labels" -}}
{{ include "pdq.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* The Redis URL the chart keeps in its Secret: redis.url, or the one of redis.sentinel. */}}
{{- define "pdq.redisURL" -}}
{{- with .Values.redis.sentinel -}}
{{- if .hosts -}}
redis+sentinel://{{ with .password }}:{{ urlquery . }}@{{ end }}{{ join "," .hosts }}/{{ .service }}/{{ int .db }}{{ with .sentinelPassword }}?sentinel_password={{ urlquery . }}{{ end }}
{{- else -}}
{{ $.Values.redis.url }}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdq.redisSecretName" -}}
{{- if .Values.redis.existingSecret -}}{{ .Values.redis.existingSecret }}{{- else -}}{{ include "pdq.fullname" . }}-redis{{- end -}}
{{- end -}}

{{- define "pdq.authSecretName" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecret }}{{- else -}}{{ include "pdq.fullname" . }}-auth{{- end -}}
{{- end -}}

{{/* What every install needs: fails the render with what to set. */}}
{{- define "pdq.checkValues" -}}
{{- $redis := compact (list .Values.redis.url (join "," .Values.redis.sentinel.hosts) .Values.redis.existingSecret) -}}
{{- if not $redis -}}
{{- fail "pdq needs Redis: set redis.url (e.g. redis://my-redis:6379/0), redis.sentinel.hosts or redis.existingSecret" -}}
{{- end -}}
{{- if gt (len $redis) 1 -}}
{{- fail "set one of redis.url, redis.sentinel.hosts and redis.existingSecret, not several" -}}
{{- end -}}
{{- if and .Values.auth.enabled (not .Values.auth.keys) (not .Values.auth.existingSecret) -}}
{{- fail "the gateway's API keys: set auth.keys (--set-file auth.keys=./keys.yaml) or auth.existingSecret, or auth.enabled=false for an open gateway" -}}
{{- end -}}
{{- if and .Values.auth.keys .Values.auth.existingSecret -}}
{{- fail "set one of auth.keys and auth.existingSecret, not both" -}}
{{- end -}}
{{- end -}}

{{/*
One role's Deployment. dict:
  root: $; role: the role's name; values: its values; args: `pdq ROLE` flags after the role;
  ports: container ports besides grpc and metrics; env: env entries (YAML text) besides the shared ones;
  mounts, volumes: its own volume mounts and volumes; autoscaled: KEDA owns the replica count.
*/}}
{{- define "pdq.deployment" -}}
{{- $root := .root -}}
{{- $v := .values -}}
{{- $name := printf "%s-%s" (include "pdq.fullname" $root) .role -}}
{{- $mounts := .mounts | default list -}}
{{- $volumes := .volumes | default list -}}
{{- if and $root.Values.model.volume (ne .role "scheduler") -}}
{{- $mounts = append $mounts (dict "name" "model" "mountPath" $root.Values.model.mountPath "readOnly" true) -}}
{{- $volumes = append $volumes (merge (dict "name" "model") $root.Values.model.volume) -}}
{{- end -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "pdq.labels" . | nindent 4 }}
spec:
  {{- if not .autoscaled }}
  replicas: {{ int $v.replicas }}
  {{- end }}
  {{- with $v.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdq.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdq.labels" . | nindent 8 }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/config.yaml") $root | sha256sum }}
        checksum/secrets: {{ include (print $root.Template.BasePath "/secrets.yaml") $root | sha256sum }}
        {{- if $root.Values.metrics.podAnnotations }}
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ int $root.Values.metrics.port | quote }}
        prometheus.io/path: /metrics
        {{- end }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      terminationGracePeriodSeconds: {{ int $v.terminationGracePeriodSeconds }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .role }}
          image: "{{ $root.Values.image.repository }}:{{ $root.Values.image.tag | default $root.Chart.AppVersion }}"
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command:
            - pdq
            - {{ .role }}
            - --host
            - 0.0.0.0
            - --port
            - {{ int $v.port | quote }}
            {{- range .args }}
            - {{ . | quote }}
            {{- end }}
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          envFrom:
            - configMapRef: {name: {{ include "pdq.fullname" $root }}-config}
          env:
            - name: PDQ_REDIS_URL
              valueFrom:
                secretKeyRef:
                  name: {{ include "pdq.redisSecretName" $root }}
                  key: {{ ternary $root.Values.redis.existingSecretKey "url" (not (empty $root.Values.redis.existingSecret)) }}
            {{- with .env }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - {name: grpc, containerPort: {{ int $v.port }}}
            {{- range .ports }}
            - {name: {{ .name }}, containerPort: {{ int .containerPort }}}
            {{- end }}
            - {name: metrics, containerPort: {{ int $root.Values.metrics.port }}}
          {{- with $v.readinessProbe }}
          readinessProbe:
            grpc: {port: {{ int $v.port }}}
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $v.livenessProbe }}
          livenessProbe:
            grpc: {port: {{ int $v.port }}}
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $v.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $mounts }}
          volumeMounts:
            {{- toYaml . | nindent 12 }}
          {{- end }}
      {{- with $volumes }}
      volumes:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* One role's PodDisruptionBudget, when its pdb.enabled. dict: root, role, values. */}}
{{- define "pdq.pdb" -}}
{{- with .values.pdb -}}
{{- if .enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "pdq.fullname" $.root }}-{{ $.role }}
  labels:
    {{- include "pdq.labels" $ | nindent 4 }}
spec:
  {{- if hasKey . "minAvailable" }}
  minAvailable: {{ .minAvailable }}
  {{- else }}
  maxUnavailable: {{ .maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdq.selectorLabels" $ | nindent 6 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Env entries of a worker: its pod IP as the address others dial, its pod name as its id. */}}
{{- define "pdq.workerEnv" -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: PDQ_ADVERTISE_ADDRESS
  value: "$(POD_IP):{{ int . }}"
- name: PDQ_WORKER_ID
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
{{- end -}}
