# conf/ is installed as the package `specheads.conf` (setup.py), so that an installed specheads
# carries the configs its commands compose; this file lets an editable install import it too.
