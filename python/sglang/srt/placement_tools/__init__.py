"""Operator tools over sglang's scheduler placement (``numa_utils``): ``plan`` shows
where each rank of an engine runs and why, ``verify`` starts probe ranks through
sglang's own launch paths and reads each binding back, ``capture`` copies the sysfs
files placement reads. Nothing in sglang imports them."""
