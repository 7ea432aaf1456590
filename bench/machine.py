"""The CPU a benchmark ran on, as its tables name it (every figure names its CPU)."""
import platform


def cpu_model():
    """/proc/cpuinfo's model name with its family and model ("AMD EPYC (family 25
    model 1)": some VMs report the bare brand), or what platform knows."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']} model {fields.get('model', '?')})"
    return name
